"""The Trainium backend: torch-neuronx + neuronx-distributed (NxD 0.17, Neuron SDK 2.28), as a ``Backend``.

The only module that imports ``torch_xla`` / ``neuronx_distributed``, and only inside ``setup`` (``_import_api``):
importing them reads the ``XLA_*`` variables once. The config's mapping onto NxD is ``neuron_plan``, the decoder on
NxD's layers ``neuron_model``; docs/trn1.md says what runs where. **Nothing in this module has run on a trn1 host**:
it runs against the real NxD 0.17 on CPU in the NxD lane and against the recording fake of the main suite.
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

from hlat.backends import graphs as ph
from hlat.backends.base import EXTRA, Env, read_extra
from hlat.backends.graphs import GraphLedger, hlo_dump_env
from hlat.backends.neuron_graphs import emit, graph_metrics, neuron_ledger
from hlat.backends.neuron_init import move_parameters
from hlat.backends.neuron_model import ModuleInit, NeuronTransformer, NxDLayers
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
from hlat.backends.neuron_shards import hlat_name, tp_split
from hlat.backends.neuron_sync import HostBarrier
from hlat.backends.torch.dist import Ranks
from hlat.config import ConfigError, RunConfig
from hlat.parallel import ParallelDims
from hlat.plan.memory import planned_budget

__all__ = [
    "XLA_MODULES",
    "NeuronBackend",
    "NeuronPrecision",
    "apply_env",
    "check_supported",
    "checkpoint_calls",
    "model_options",
    "neuron_env",
    "nxd_config_kwargs",
    "precision_plan",
]


@dataclass(frozen=True)
class _Api:
    """The torch_xla / NxD entry points the backend calls, imported once by ``setup``."""

    xm: Any
    """``torch_xla.core.xla_model`` (step closures, rendezvous, all-reduce on the device)."""
    device: Callable[[], torch.device]
    """``torch_xla.device`` (torch-xla 2.9's name for the deprecated ``xm.xla_device``); the CPU in NxD's CPU mode."""
    sync: Callable[[], None]
    """``torch_xla.sync`` (for the deprecated ``xm.mark_step``): cut and run the traced graph, then the closures."""
    nxd: Any
    """``neuronx_distributed`` (config, model, optimizer, checkpoints)."""
    layers: NxDLayers
    """The parallel layers and loss ``neuron_model.NeuronTransformer`` is built from."""
    manual_seed: Callable[[int], None]
    """``parallel_layers.model_parallel_xla_manual_seed``."""


def _import_api(cpu_mode: bool = False) -> _Api:
    """Import torch_xla and NxD (NxD's public API: its ``__init__.py``); the environment must be set before.

    ``cpu_mode`` (``cluster.nxd_cpu_mode``): NxD's CPU mode, where the model and every tensor stay on the CPU.

    Raises:
        ConfigError: when the Neuron packages are not installed (they are not on PyPI: only the trn1 image has them).
    """
    try:
        import neuronx_distributed as nxd
        import torch_xla
        import torch_xla.core.xla_model as xm
    except ImportError as e:  # PyPI's torch-neuronx / neuronx-distributed are placeholders that raise ImportError
        raise ConfigError(
            f"cluster.backend=neuron needs torch-neuronx and neuronx-distributed of Neuron SDK 2.28 ({e}); they come "
            "from the Neuron repository, not PyPI: run on a trn1 host inside hlat's image (docker build --target "
            "trn1), or train elsewhere with cluster=cpu or gpu_1x. `train.dry_run=true` plans a trn1 run anywhere"
        ) from None
    import torch_xla.distributed.xla_backend  # registers the "xla" torch.distributed backend
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import (
        ColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
        model_parallel_xla_manual_seed,
        parallel_cross_entropy,
    )

    layers = NxDLayers(
        column=ColumnParallelLinear,
        row=RowParallelLinear,
        qkv=GQAQKVColumnParallelLinear,
        embedding=ParallelEmbedding,
        cross_entropy=parallel_cross_entropy,
    )
    device = (lambda: torch.device("cpu")) if cpu_mode else torch_xla.device
    return _Api(
        xm=xm, device=device, sync=torch_xla.sync, nxd=nxd, layers=layers, manual_seed=model_parallel_xla_manual_seed
    )


class NeuronBackend:
    """NxD on trn1: parallel layers, NxD optimizer (ZeRO-1), pipeline engine, xser checkpoints, step closures.

    It takes the whole run config: the environment, the NxD config and the pipeline's micro-batch count depend on
    parallelism, precision, optimizer and train settings together (``get_backend(cfg)``).
    """

    name = "neuron"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.plan = precision_plan(cfg.precision, cfg.parallelism, cfg.train.seed)
        self.upcast = getattr(torch, self.plan.upcast_dtype)
        self.ranks = Ranks(0, 1, 0, 1)
        self.dims: ParallelDims | None = None
        self.device = torch.device("cpu")
        self.cpu_mode = cfg.cluster.nxd_cpu_mode
        """NxD's CPU mode (``cluster.nxd_cpu_mode``): model and tensors on the CPU, collectives over gloo."""
        self.nxd_config: dict[str, Any] = {}
        self._api: _Api | None = None
        self.barrier: HostBarrier | None = None
        """Every rank's wait at checkpoints (``neuron_sync``), from ``setup`` on."""
        self.ledger: GraphLedger | None = None
        """Which phases compiled new graphs (``hlat.backends.graphs``), from ``setup`` on."""

    @property
    def api(self) -> _Api:
        """The imported torch_xla / NxD entry points (after ``setup``)."""
        if self._api is None:
            raise RuntimeError("NeuronBackend.setup() must run first: it sets the environment and imports torch_xla")
        return self._api

    def setup(self) -> Env:
        cfg = self.cfg
        cluster, seed = cfg.cluster, cfg.train.seed
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
        dump = cfg.health.graph_hlo_dir  # every graph this rank runs as HLO, for fingerprints (hlat graphs plan)
        apply_env({**neuron_env(cfg), **(hlo_dump_env(dump, ranks.rank) if dump else {})})
        self._api = api = _import_api(cluster.nxd_cpu_mode)
        import torch_xla.debug.metrics as met  # imported by torch_xla.core.xla_model: a sys.modules lookup

        self.ledger = ledger = neuron_ledger(met, dump, ranks.rank)
        threads = cluster.num_threads
        if threads is not None:
            torch.set_num_threads(threads)
        if not dist.is_initialized():  # the timeout bounds every collective's wait (health.collective_timeout_s)
            timeout = datetime.timedelta(seconds=cfg.health.collective_timeout_s)
            backend = "gloo" if cluster.nxd_cpu_mode else "xla"  # NxD's CPU mode: collectives on CPU tensors
            if ranks.world_size == 1 and "RANK" not in os.environ:  # one process, no launcher: no env:// rendezvous
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(backend, timeout=timeout)
        # Initializes NxD's tensor/pipeline/data-parallel groups (the process group exists: NxD's ``trainer.py``).
        with ledger.phase(ph.SETUP):
            self.nxd_config = api.nxd.neuronx_distributed_config(
                **nxd_config_kwargs(cfg, param_init_fn=ModuleInit(cfg.model), world_size=ranks.world_size)
            )
        api.manual_seed(seed)  # device RNG: after model-parallel init, per TP rank (NxD's ``random.py``)
        self.barrier = HostBarrier(api.xm, cluster.nxd_cpu_mode or cluster.pjrt_device == "CPU")  # collective
        self.ranks, self.device = ranks, api.device()
        return Env(
            rank=ranks.rank,
            world_size=ranks.world_size,
            device=self.device,
            memory_budget_bytes=planned_budget(cluster),
        )

    def build_model(self, dims: ParallelDims, init_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """``NeuronTransformer`` of the run's ``model`` config, built and initialized by ``initialize_parallel_model``.

        Its parameter names are the torch decoder's; its arithmetic is on NxD's layers.
        """
        api, self.dims = self.api, dims  # the run's layout, which setup validated on the same world
        opts, layers = model_options(self.cfg, dims.world_size), api.layers
        # Parallel layers draw their full weight on the host by name and seed (NamedInit: no global RNG), then keep
        # their shard. The host generator is re-seeded anyway for anything NxD itself draws (alone: torch.manual_seed
        # would also reseed the device RNG that model_parallel_xla_manual_seed set per rank).
        torch.default_generator.manual_seed(self.cfg.train.seed)
        cfg = self.cfg.model  # a closure without arguments: NxD >= 0.10 passes include_buffers positionally after it
        with self.graphs.phase(ph.SETUP):
            model = api.nxd.initialize_parallel_model(self.nxd_config, lambda: NeuronTransformer(cfg, layers, opts))
        if self.cpu_mode and dims.pp == 1:  # NxD's CPU mode: initialize_parallel_model moved the
            move_parameters(model, self.device)  # model to xm.xla_device() whatever NXD_CPU_MODE says
        if init_state is not None:  # NxD materialized and initialized its shards: overwrite them with the given ones
            self._load_full(model, init_state, tp_rank=self.ranks.rank % dims.tp)
        return model

    @torch.no_grad()
    def _load_full(self, model: nn.Module, state: dict[str, torch.Tensor], tp_rank: int) -> None:
        """Copy this rank's piece of each full tensor of ``state`` (hlat's names, tp=1 layout) into its parameter.

        Each rank holds its pipeline stage's parameters (NxD's ``named_parameters``), cut as NxD's layers cut them
        (``neuron_shards.tp_split``; NxD's rank order puts tp innermost).
        """
        assert self.dims is not None
        for name, p in model.named_parameters():
            full = state[hlat_name(name)]
            piece = tp_split(hlat_name(name), full, self.cfg.model, self.dims.tp)[tp_rank]
            p.data.copy_(piece.to(device=p.device, dtype=p.dtype))

    def build_optimizer(self, model: nn.Module, groups: list[dict]) -> torch.optim.Optimizer:
        cfg = self.cfg.optimizer  # the NxD config was built from it too
        # torch's AdamW for every mode: with master weights NxD's ZeRO-1 keeps fp32 shards and runs it on them.
        return self.api.nxd.initialize_parallel_optimizer(
            self.nxd_config,
            torch.optim.AdamW,
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 matmuls over fp32 parameters for precision=autocast; nothing otherwise."""
        if not self.plan.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch: Any = None) -> torch.Tensor:
        """Mean token loss in the upcast dtype (fp32; float64 under downcast); a mixture's ``batch`` tallies it too."""
        with self._autocast():
            return model(inputs.to(self.device), targets.to(self.device), batch=batch)

    def forward_backward(
        self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int
    ) -> torch.Tensor:
        assert self.dims is not None
        if self.dims.pp > 1:
            # The pipeline schedule takes the step's micro-batches at once, on the host, and splits them again.
            inputs, targets = (torch.cat(t) for t in zip(*batches, strict=True))
            with self._autocast(), self.graphs.phase(ph.FORWARD_BACKWARD):
                return model.run_train(input_ids=inputs, labels=targets).detach()
        total: torch.Tensor | None = None
        for i, batch in enumerate(batches):  # a data mixture's (hlat.tally.Batch) also tallies per-source losses
            with self.graphs.phase(ph.FORWARD_BACKWARD, micro=i):
                loss = self.loss(model, *batch, batch=batch) / n
                loss.backward()
                self.api.sync()  # one graph per micro-batch, as NxD's MpDeviceLoader cuts them
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None, "a step has at least one micro-batch"
        return total

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, bool]:
        # train.on_nonfinite=skip_step is refused by check_supported; NxD clips to optimizer.clip_grad_norm itself.
        optimizer.step()  # sequence- and data-parallel all-reduce, clip, AdamW; no all-reduce of our own
        return optimizer.grad_norm, True

    def step_end(self) -> None:
        with self.graphs.phase(ph.OPTIMIZER):  # the update traced since the last micro-batch runs here
            self.api.sync()

    @property
    def graphs(self) -> GraphLedger:
        """The graph ledger (after ``setup``)."""
        if self.ledger is None:
            raise RuntimeError("NeuronBackend.setup() must run first: the graph ledger reads torch_xla's counters")
        return self.ledger

    def graph_ledger(self) -> GraphLedger | None:
        return self.ledger

    def param_norm(self, model: nn.Module) -> torch.Tensor:
        """Global L2 norm of the whole model's parameters, the same on every rank (``train/param_norm``).

        Each rank holds a part: its pipeline stage only (NxD's ``named_parameters`` under PP), the shards of the
        tensor-parallel parameters (``tensor_model_parallel``) and copies of the others. Each rank adds its squares,
        the copies divided by the number of ranks holding them (tp, and dp for every parameter), and one all-reduce
        sums the parts. Parameters of ``kv_size_multiplier`` copies count once per copy (as NxD's grad norm does).
        """
        assert self.dims is not None
        tp, dp = self.dims.tp, self.dims.dp
        total = torch.zeros((), dtype=self.upcast, device=self.device)
        for p in model.parameters():
            copies = dp * (1 if getattr(p, "tensor_model_parallel", False) else tp)
            total = total + p.detach().to(self.upcast).pow(2).sum() / copies
        if self.ranks.world_size > 1:
            if self.cpu_mode:
                dist.all_reduce(total)
            else:
                total = self.api.xm.all_reduce(self.api.xm.REDUCE_SUM, total)
        return total.sqrt()

    def synchronize(self) -> None:
        with self.graphs.phase(ph.SYNC):
            self.api.sync()  # run what was traced so far, then wait for the device to finish it
            self.api.xm.wait_device_ops()

    def fetch(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, list[float]]], None]) -> None:
        xm = self.api.xm
        names = list(tensors)
        flat = [tensors[k].detach().reshape(-1).to(self.upcast) for k in names]
        values = torch.cat(flat) if flat else torch.zeros(0, dtype=self.upcast, device=self.device)
        if self.ranks.world_size > 1:  # mean over ranks: the loss over data parallelism, norms are equal anyway
            if self.cpu_mode:  # NxD's CPU mode: gloo
                values = values / self.ranks.world_size
                dist.all_reduce(values)
            else:
                values = xm.all_reduce(xm.REDUCE_SUM, values / self.ranks.world_size)
        sizes = [t.numel() for t in flat]
        xm.add_step_closure(emit, (values, names, sizes, fn))
        # A small graph of its own (the step's graph has run at step_end): its closures run once values exist.
        with self.graphs.phase(ph.FETCH):
            self.api.sync()

    def host_metrics(self) -> dict[str, float]:
        """``xla/*``: graphs compiled, compile seconds, executions, transfers (``neuron_graphs.graph_metrics``)."""
        import torch_xla.debug.metrics as met  # torch_xla.core.xla_model (setup) imported it: a sys.modules lookup

        return graph_metrics(met)

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, async_save: bool
    ) -> Future | None:
        # Synchronous on purpose, whatever train.async_checkpoint says (the Checkpointer still checksums and renames
        # in the background): NxD's async save finishes in CheckpointIOState.wait_save, which needs xm.rendezvous on
        # the main thread and writes its "done" marker late, into a directory the Checkpointer has renamed by then.
        # HLAT's own scripts saved synchronously with xser too (github.com/awslabs/HLAT).
        kwargs, _ = checkpoint_calls(path, extra, async_save=False, zero1=self.cfg.parallelism.zero1)
        with self.graphs.phase(ph.CHECKPOINT):
            self.barrier.wait("hlat-checkpoint-dir")  # rank 0 has (re)created `path`: now every rank writes into it
            torch.save(extra, path / EXTRA.format(rank=self.ranks.rank))
            with self.barrier.standing_in():
                self.api.nxd.save_checkpoint(model=model, optimizer=optimizer, **kwargs)  # ends with a rendezvous
        return None

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        _, kwargs = checkpoint_calls(path, {}, async_save=False, zero1=self.cfg.parallelism.zero1)
        with self.barrier.standing_in(), self.graphs.phase(ph.RESTORE):
            self.api.nxd.load_checkpoint(model=model, optimizer=optimizer, **kwargs)
        return read_extra(path, self.ranks.rank)  # rank 0's for a rank the saving run had not
