"""The Trainium backend: torch-neuronx + neuronx-distributed (NxD 0.17, Neuron SDK 2.28; reference neuron-nxd.md).

The only module that imports ``torch_xla`` / ``neuronx_distributed``, and only inside ``_import_api`` (called by
``setup``): those wheels come from the Neuron repository in the Docker image, and importing them reads the
``XLA_*`` variables once. The pure mapping of the config (environment, NxD config, precision, checkpoint calls)
is in ``hlat.backends.neuron_plan`` and re-exported here; the decoder on NxD parallel layers is
``hlat.backends.neuron_model``.

A run on trn1, in order (``run.main`` -> ``loop.fit``):

- ``setup``: validate (``ParallelDims``, ``check_supported``, ``precision_plan``), ``apply_env(neuron_env(cfg))``,
  import torch_xla and NxD, ``dist.init_process_group("xla")``, ``neuronx_distributed_config(...)`` (which
  initializes tensor/pipeline parallel state), ``model_parallel_xla_manual_seed(seed)``.
- ``build_model``: ``initialize_parallel_model(nxd_config, closure)``; the zero-argument closure sidesteps the
  ``include_buffers`` positional argument of NxD >= 0.10 (reference §1.3). NxD builds the ``Transformer`` on the meta
  device, ``to_neuron`` swaps in the parallel layers, NxD wraps it in ``NxDPPModel`` with PP, materializes it with
  ``ModuleInit`` and applies activation checkpointing.
- ``build_optimizer``: ``initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups, ...)``; ZeRO-1 and
  master weights come from the NxD config.
- per step: ``forward_backward`` (micro-batch forward + backward with an ``xm.mark_step`` after each, or with PP
  ``model.run_train`` over all micro-batches at once), ``update`` (``optimizer.step()``: NxD all-reduces sequence-
  and data-parallel gradients, clips, steps; ``optimizer.grad_norm`` is the norm before clipping), ``step_end``
  (``xm.mark_step``). Metrics leave the device in ``fetch`` through ``xm.add_step_closure``.
- checkpoints: ``nxd.save_checkpoint`` / ``load_checkpoint`` (xser) into the directory ``hlat.checkpoint`` gives,
  train state and loader position in ``user_content`` and in one small file per rank.

**Nothing in this module has run on a trn1 host.** It is written against the API of reference §1-§2 and exercised on
CPU only, through the recording fake of the tests (``tests/fakes/neuron_api.py``), which checks the calls, their
arguments and their order, not what NxD does with them. Known gaps: ``train/param_norm`` is the mean over ranks of
each rank's local-shard norm (not the global norm) when tp or pp > 1; per-layer gradient norms (``grad_hooks``) are
taken before NxD's data-parallel all-reduce; ``precision=autocast`` with pipeline parallelism relies on NxD
picking up the ``xla`` autocast state.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hlat.backends.base import Env
from hlat.backends.neuron_model import ModuleInit, NxDLayers, to_neuron
from hlat.backends.neuron_plan import (
    XLA_MODULES,
    NeuronPrecision,
    apply_env,
    check_supported,
    checkpoint_calls,
    model_options,
    neuron_env,
    nxd_config_kwargs,
    precision_plan,
)
from hlat.backends.torch_dist import Ranks
from hlat.config import ClusterConfig, ConfigError, OptimizerConfig, ParallelismConfig, PrecisionConfig, RunConfig
from hlat.parallel import ParallelDims
from hlat.plan import planned_budget

__all__ = [
    "XLA_MODULES", "NeuronBackend", "NeuronPrecision", "apply_env", "check_supported", "checkpoint_calls",
    "model_options", "neuron_env", "nxd_config_kwargs", "precision_plan",
]  # fmt: skip

EXTRA = "extra.rank{rank}.pt"
"""This rank's ``extra`` (its data-loader position): NxD writes ``user_content`` from global rank 0 only."""


@dataclass(frozen=True)
class _Api:
    """The torch_xla / NxD entry points the backend calls, imported once by ``setup``."""

    xm: Any
    """``torch_xla.core.xla_model``."""
    nxd: Any
    """``neuronx_distributed`` (config, model, optimizer, checkpoints)."""
    layers: NxDLayers
    """The parallel layers and loss of ``neuron_model.to_neuron``."""
    manual_seed: Callable[[int], None]
    """``parallel_layers.model_parallel_xla_manual_seed``."""


def _import_api() -> _Api:
    """Import torch_xla and NxD (reference §1.1, §1.5, §1.6); the environment must be set before.

    Raises:
        ConfigError: when the Neuron packages are not installed (they are not on PyPI: only the trn1 image has them).
    """
    try:
        import neuronx_distributed as nxd
        import torch_xla.core.xla_model as xm
    except ImportError as e:  # PyPI's torch-neuronx / neuronx-distributed are placeholders that raise ImportError
        raise ConfigError(
            f"cluster.backend=neuron needs torch-neuronx and neuronx-distributed of Neuron SDK 2.28 ({e}); they come "
            "from the Neuron repository, not PyPI: run on a trn1 host inside hlat's image (docker build --target "
            "trn1), or train elsewhere with cluster=cpu or gpu_1x. `train.dry_run=true` plans a trn1 run anywhere"
        ) from None
    import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" torch.distributed backend
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
        model_parallel_xla_manual_seed,
        parallel_cross_entropy,
    )

    layers = NxDLayers(column=ColumnParallelLinear, row=RowParallelLinear, qkv=GQAQKVColumnParallelLinear,
                       embedding=ParallelEmbedding, cross_entropy=parallel_cross_entropy)  # fmt: skip
    return _Api(xm=xm, nxd=nxd, layers=layers, manual_seed=model_parallel_xla_manual_seed)


class NeuronBackend:
    """NxD on trn1: parallel layers, NxD optimizer (ZeRO-1), pipeline engine, xser checkpoints, step closures.

    It takes the whole run config: the environment, the NxD config and the pipeline's micro-batch count depend on
    parallelism, precision, optimizer and train settings together (``get_backend("neuron", cfg)``).
    """

    name = "neuron"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.plan = precision_plan(cfg.precision, cfg.parallelism, cfg.train.seed)
        self.upcast = getattr(torch, self.plan.upcast_dtype)
        self.ranks = Ranks(0, 1, 0, 1)
        self.dims: ParallelDims | None = None
        self.device = torch.device("cpu")
        self.nxd_config: dict[str, Any] = {}
        self._api: _Api | None = None

    @property
    def api(self) -> _Api:
        """The imported torch_xla / NxD entry points (after ``setup``)."""
        if self._api is None:
            raise RuntimeError("NeuronBackend.setup() must run first: it sets the environment and imports torch_xla")
        return self._api

    def setup(self, cluster: ClusterConfig, precision: PrecisionConfig, seed: int) -> Env:
        cfg = self.cfg
        assert (cluster, precision, seed) == (cfg.cluster, cfg.precision, cfg.train.seed), "not this run's config"
        ranks = Ranks.from_env()  # RANK, WORLD_SIZE, LOCAL_RANK as torchrun sets them
        # Validate everything before the runtime starts or anything compiles.
        self.dims = ParallelDims.build(cfg.parallelism, ranks.world_size, cfg.model, cfg.train)
        if cfg.train.compile:
            raise ConfigError(
                "train.compile=true is for the torch backend (torch.compile); on the neuron backend torch_xla traces "
                "the step and neuronx-cc compiles the whole graph anyway: set train.compile=false"
            )
        if cfg.train.step_breakdown:
            raise ConfigError(
                "train.step_breakdown=true times eager phases of the torch backend; on the neuron backend a step is "
                "one lazily traced XLA graph, so forward, backward and optimizer cannot be timed apart without "
                "cutting it: set train.step_breakdown=false (perf/step_time_s is still logged)"
            )
        if cfg.model.mask_leak:
            raise ConfigError(
                f"model.mask_leak={cfg.model.mask_leak} (the information-leak demonstration) runs on the torch backend "
                "only: NxD's attention is always causal; set model.mask_leak=0"
            )
        apply_env(neuron_env(cfg))
        self._api = api = _import_api()
        if not dist.is_initialized():  # the timeout bounds every collective's wait (health.collective_timeout_s)
            timeout = datetime.timedelta(seconds=cfg.health.collective_timeout_s)
            if ranks.world_size == 1 and "RANK" not in os.environ:  # one process, no launcher: no env:// rendezvous
                dist.init_process_group("xla", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group("xla", timeout=timeout)
        # Initializes NxD's tensor/pipeline/data-parallel groups (the process group exists: reference §1.2).
        self.nxd_config = api.nxd.neuronx_distributed_config(
            **nxd_config_kwargs(cfg, param_init_fn=ModuleInit(cfg.model), world_size=ranks.world_size)
        )
        api.manual_seed(seed)  # device RNG: after model-parallel init, per TP rank (reference §1.6)
        self.ranks, self.device = ranks, api.xm.xla_device()
        return Env(rank=ranks.rank, world_size=ranks.world_size, device=self.device,
                   memory_budget_bytes=planned_budget(cluster))  # fmt: skip

    def build_model(self, model_fn: Callable[[], nn.Module], dims: ParallelDims, par: ParallelismConfig | None = None,
                    init_state: dict[str, torch.Tensor] | None = None) -> nn.Module:  # fmt: skip
        if init_state is not None:
            raise ConfigError(
                "train.init_from is not built on the neuron backend yet (NxD materializes the sharded model itself): "
                "start the run on the torch backend, or leave train.init_from unset"
            )
        api = self.api
        assert dims == self.dims and par in (None, self.cfg.parallelism), "not this run's layout"
        opts, layers = model_options(self.cfg, dims.world_size), api.layers
        # Parallel layers draw their full weight on the host, then keep their shard: every rank must draw the same
        # numbers whatever ran since setup (the data loader), so re-seed the host generator alone (torch.manual_seed
        # would also reseed the device RNG that model_parallel_xla_manual_seed set per rank).
        torch.default_generator.manual_seed(self.cfg.train.seed)
        return api.nxd.initialize_parallel_model(self.nxd_config, lambda: to_neuron(model_fn(), layers, opts))

    def build_optimizer(self, model: nn.Module, groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        assert cfg == self.cfg.optimizer, "the NxD config was built from the run's optimizer config"
        # torch's AdamW for every mode: with master weights NxD's ZeRO-1 keeps fp32 shards and runs it on them.
        return self.api.nxd.initialize_parallel_optimizer(
            self.nxd_config, torch.optim.AdamW, groups,
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        )  # fmt: skip

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 matmuls over fp32 parameters for precision=autocast; nothing otherwise."""
        if not self.plan.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss in the upcast dtype (fp32 on the device; float64 stands for fp32 under downcast)."""
        with self._autocast():
            return model(inputs.to(self.device), targets.to(self.device))

    def forward_backward(self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         n: int) -> torch.Tensor:  # fmt: skip
        assert self.dims is not None
        if self.dims.pp > 1:
            # The pipeline schedule takes the step's micro-batches at once, on the host, and splits them again.
            inputs, targets = (torch.cat(t) for t in zip(*batches, strict=True))
            with self._autocast():
                return model.run_train(input_ids=inputs, labels=targets).detach()
        total: torch.Tensor | None = None
        for inputs, targets in batches:
            loss = self.loss(model, inputs, targets) / n
            loss.backward()
            self.api.xm.mark_step()  # one graph per micro-batch, as NxD's MpDeviceLoader cuts them
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None, "a step has at least one micro-batch"
        return total

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, *,
               skip_nonfinite: bool) -> tuple[torch.Tensor, bool]:  # fmt: skip
        assert not skip_nonfinite, "train.on_nonfinite=skip_step is refused by check_supported"
        assert max_norm == self.cfg.optimizer.clip_grad_norm, "NxD clips to the config's optimizer.clip_grad_norm"
        optimizer.step()  # sequence- and data-parallel all-reduce, clip, AdamW; no all-reduce of our own
        return optimizer.grad_norm, True

    def step_end(self) -> None:
        self.api.xm.mark_step()

    def synchronize(self) -> None:
        self.api.xm.mark_step()  # run what was traced so far, then wait for the device to finish it
        self.api.xm.wait_device_ops()

    def fetch(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, list[float]]], None]) -> None:
        xm = self.api.xm
        names = list(tensors)
        flat = [tensors[k].detach().reshape(-1).to(self.upcast) for k in names]
        values = torch.cat(flat) if flat else torch.zeros(0, dtype=self.upcast, device=self.device)
        if self.ranks.world_size > 1:  # mean over ranks: the loss over data parallelism, norms are equal anyway
            values = xm.all_reduce(xm.REDUCE_SUM, values / self.ranks.world_size)
        sizes = [t.numel() for t in flat]
        xm.add_step_closure(_emit, (values, names, sizes, fn))
        # A small graph of its own (the step's graph has run at step_end): its closures run once values exist.
        xm.mark_step()

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *,
             async_save: bool) -> Future | None:  # fmt: skip
        # Synchronous on purpose, whatever train.async_checkpoint says (the Checkpointer still checksums and renames
        # in the background): NxD's async save finishes in CheckpointIOState.wait_save, which needs xm.rendezvous on
        # the main thread and writes its "done" marker late, into a directory the Checkpointer has renamed by then.
        # HLAT's own scripts saved synchronously with xser too (reference §7).
        xm = self.api.xm
        xm.rendezvous("hlat-checkpoint-dir")  # rank 0 has (re)created `path`: now every rank writes into it
        torch.save(extra, path / EXTRA.format(rank=self.ranks.rank))
        kwargs, _ = checkpoint_calls(path, extra, async_save=False, zero1=self.cfg.parallelism.zero1)
        self.api.nxd.save_checkpoint(model=model, optimizer=optimizer, **kwargs)  # ends with a rendezvous
        return None

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        _, kwargs = checkpoint_calls(path, {}, async_save=False, zero1=self.cfg.parallelism.zero1)
        self.api.nxd.load_checkpoint(model=model, optimizer=optimizer, **kwargs)
        # weights_only: a checkpoint is data; refusing pickled code keeps a shared checkpoint from running it.
        return torch.load(path / EXTRA.format(rank=self.ranks.rank), map_location="cpu", weights_only=True)


def _emit(values: torch.Tensor, names: list[str], sizes: list[int], fn: Callable) -> None:
    """Step closure of ``fetch``: one device-to-host copy, split back into named lists of floats."""
    host = values.cpu().tolist()
    out, i = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = host[i : i + size]
        i += size
    fn(out)


def build_backend(cfg: RunConfig | None) -> NeuronBackend:
    """``get_backend("neuron", cfg)``: the backend needs the whole run config.

    Raises:
        ConfigError: without one.
    """
    if cfg is None:
        raise ConfigError(
            "cluster.backend=neuron needs the whole run config (get_backend(cfg.cluster.backend, cfg)): its "
            "environment, NxD config and pipeline micro-batches depend on parallelism, precision, optimizer and train"
        )
    return NeuronBackend(cfg)
