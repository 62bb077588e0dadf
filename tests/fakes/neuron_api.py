"""A RECORDING FAKE of torch_xla and neuronx_distributed (NxD 0.17), for CPU tests of hlat.backends.neuron.

This is not NxD, and where it and the real library disagree the real one wins and this file changes. The real NxD
0.17 runs in the NxD lane (``make test-neuron``, tests/neuron: world 1 on XLA:CPU, TP/PP in NxD's CPU mode), which
is the oracle for NxD's behaviour. This fake stays for what the lane cannot run on a CPU machine and for the main
suite, which has no torch-xla: multi-rank XLA collectives (trn1's all-reduce sums; XLA:CPU processes return their
local value), sequence parallelism with the GQA qkv layer (its backward calls ``xm.all_gather`` directly, which
fails on CPU tensors), the exact calls, arguments and order the backend makes (neuronx-cc environment, checkpoint
keyword arguments, the env/launch mapping), and fast unit tests of the backend's control flow. Known differences,
kept on purpose: the layers are degree 1, so the TP attributes and the per-stage initialization of the real NxD are
exercised only in the lane.
 It serves ``import torch_xla...`` / ``import neuronx_distributed...`` from a meta-path finder
that a test installs (``FakeNeuronApi.install``) and removes afterwards, records every call with its arguments
(``FakeNeuronApi.calls``), and behaves like NxD on ONE NeuronCore so that real training steps run on CPU:

- the API functions have the real signatures of NxD 0.17 (``trainer``, ``parallel_layers``, ``pipeline``), bound with
  ``inspect.Signature.bind``, so an argument NxD does not take fails the test as it would fail on trn1;
- the parallel layers are plain linears/embeddings of the full size (tensor-parallel degree 1: every gather and
  reduce is the identity), keep NxD's parameter names and ``[S, B, H]`` sequence-parallel layout, and initialize on
  the host only when not on the meta device (``init_weight_cpu`` / ``initialize_weight_biases``);
- ``initialize_parallel_model`` builds on the meta device (parameters only, as NxD's ``init_on_device``), fills
  every parameter with NaN, calls the ``param_init_fn`` per module (so a parameter it misses stays NaN), wraps the
  configured classes (with PP the blocks) in a checkpoint wrapper as NxD does and, with PP, traces the model with
  torch.fx as NxD's torch tracer does and runs all stages in this one process (``run_train`` splits the batch into
  micro-batches, scales each loss by 1/num_microbatches);
- the optimizer wrapper clips inside ``step()`` and exposes the pre-clip ``grad_norm``; it refuses master weights
  without ZeRO-1 as NxD does;
- ``torch_xla.sync`` (and ``xm.mark_step``) run the pending step closures; ``xm.all_reduce`` multiplies by the
  world size (every rank is assumed to hold the same value); checkpoints are torch.save files in NxD's layout.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, CheckpointWrapper

FAKE_PACKAGES = ("torch_xla", "neuronx_distributed")
WATCHED_ENV = (
    "XLA_USE_BF16",
    "XLA_DOWNCAST_BF16",
    "NEURON_RT_STOCHASTIC_ROUNDING_EN",
    "NEURON_CC_FLAGS",
    "NEURON_COMPILE_CACHE_URL",
)
"""Variables whose value at ``import torch_xla`` time the fake records (torch_xla reads them then)."""


@dataclass
class Call:
    """One recorded call."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


# --- the real signatures (NxD 0.17), used to bind what the backend passes -----------------------------------------


def _sig_column(
    input_size,
    output_size,
    bias=True,
    gather_output=True,
    dtype=torch.float32,
    device=None,
    stride=1,
    init_method=None,
    sequence_parallel_enabled=False,
    sequence_dimension=None,
    keep_master_weight=False,
    skip_bias_add=False,
    pad=False,
    pad_alignment_size_per_rank=1,
    keep_padded_output=False,
    tensor_model_parallel_group=None,
    reduce_dtype=torch.float32,
    rank_ordering=None,
): ...


def _sig_row(
    input_size,
    output_size,
    bias=True,
    input_is_parallel=False,
    dtype=torch.float32,
    device=None,
    stride=1,
    init_method=None,
    sequence_parallel_enabled=False,
    sequence_dimension=None,
    keep_master_weight=False,
    skip_bias_add=False,
    pad=False,
    reduce_output=True,
    tensor_model_parallel_group=None,
    reduce_dtype=torch.float32,
    tile_cc=False,
    rank_ordering=None,
): ...


def _sig_embedding(
    num_embeddings,
    embedding_dim,
    padding_idx=None,
    max_norm=None,
    norm_type=2.0,
    scale_grad_by_freq=False,
    sparse=False,
    init_method=nn.init.normal_,
    device=None,
    dtype=torch.float32,
    shard_across_embedding=False,
    pad=False,
    sequence_parallel_enabled=False,
    tensor_model_parallel_group=None,
    use_spmd_rank=False,
    sequence_dimension=None,
    tile_cc=False,
    rank_ordering=None,
    collect_output=True,
): ...


def _sig_qkv(
    input_size,
    output_sizes,
    bias=True,
    gather_output=True,
    dtype=torch.float32,
    device=None,
    init_method=None,
    sequence_parallel_enabled=False,
    keep_master_weight=False,
    kv_size_multiplier=1,
    fuse_qkv=True,
    reduce_dtype=torch.float32,
): ...


def _sig_nxdpp(
    module,
    transformer_layer_cls=None,
    num_microbatches=1,
    virtual_pipeline_size=1,
    output_loss_value_spec=None,
    return_mb_loss=False,
    broadcast_and_average_loss=False,
    use_zero1_optimizer=False,
    use_model_wrapper=False,
    use_optimizer_wrapper=False,
    pipeline_cuts=None,
    input_names=None,
    leaf_module_cls=None,
    autowrap_functions=None,
    autowrap_modules=None,
    autowrap_obj_methods=None,
    tracer_cls=None,
    param_init_fn=None,
    trace_file_path=None,
    return_loss_on_cpu=True,
    deallocate_pipeline_outputs=False,
    auto_partition=False,
    fuse_microbatches=False,
): ...


# --- fake parallel layers (tensor-parallel degree 1) ----------------------------------------------------------------


class _Recorded(nn.Module):
    """Binds the constructor arguments against the real signature and records them."""

    SIGNATURE: Callable = staticmethod(_sig_column)
    api: FakeNeuronApi | None = None

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = _signature(self.SIGNATURE).bind(*args, **kwargs)
        if self.api is not None:
            self.api.record(type(self).__name__, **bound.arguments)
        full = _signature(self.SIGNATURE).bind(*args, **kwargs)
        full.apply_defaults()
        return full.arguments


class ColumnParallelLinear(_Recorded):
    """FAKE ``parallel_layers.ColumnParallelLinear`` (tp 1: the sequence all-gather is the identity)."""

    SIGNATURE = staticmethod(_sig_column)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        a = self._bind(args, kwargs)
        self.init_method, self.sequence_parallel_enabled = a["init_method"], a["sequence_parallel_enabled"]
        self.weight = nn.Parameter(torch.empty(a["output_size"], a["input_size"], dtype=a["dtype"]))
        self.bias = nn.Parameter(torch.zeros(a["output_size"], dtype=a["dtype"])) if a["bias"] else None
        if self.weight.device.type != "meta":
            self.init_weight_cpu()

    def init_weight_cpu(self) -> None:
        with torch.no_grad():
            if self.init_method is not None:
                self.init_method(self.weight)
            else:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(ColumnParallelLinear):
    """FAKE ``parallel_layers.RowParallelLinear`` (tp 1: the all-reduce / reduce-scatter is the identity)."""

    SIGNATURE = staticmethod(_sig_row)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        a = _signature(_sig_row).bind(*args, **kwargs)
        a.apply_defaults()
        if a.arguments["sequence_parallel_enabled"] and not a.arguments["input_is_parallel"]:
            raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
        super().__init__(*args, **kwargs)


class ParallelEmbedding(_Recorded):
    """FAKE ``parallel_layers.ParallelEmbedding``: with sequence parallelism the output is ``[S, B, H]``."""

    SIGNATURE = staticmethod(_sig_embedding)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        a = self._bind(args, kwargs)
        self.init_method, self.sequence_parallel_enabled = a["init_method"], a["sequence_parallel_enabled"]
        self.weight = nn.Parameter(torch.empty(a["num_embeddings"], a["embedding_dim"], dtype=a["dtype"]))
        if self.weight.device.type != "meta":
            self.init_weight_cpu()

    def init_weight_cpu(self) -> None:
        with torch.no_grad():
            self.init_method(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)  # (B, S, H)
        return out.transpose(0, 1).contiguous() if self.sequence_parallel_enabled else out


class GQAQKVColumnParallelLinear(_Recorded):
    """FAKE ``modules.qkv_linear.GQAQKVColumnParallelLinear``: one fused ``weight_qkv`` [q; k; v], returns (q, k, v)."""

    SIGNATURE = staticmethod(_sig_qkv)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        a = self._bind(args, kwargs)
        if not a["fuse_qkv"]:
            raise NotImplementedError("the fake only has the fused layout")
        self.init_method = a["init_method"]
        self.output_sizes = list(a["output_sizes"])
        self.q_output_size_per_partition = self.output_sizes[0]  # tensor-parallel degree 1
        self.sizes = [a["output_sizes"][0], a["output_sizes"][1], a["output_sizes"][1]]
        self.weight_qkv = nn.Parameter(torch.empty(sum(self.sizes), a["input_size"], dtype=a["dtype"]))
        if self.weight_qkv.device.type != "meta":
            self.initialize_weight_biases()

    def initialize_weight_biases(self) -> None:
        """As NxD 0.17: q, k, v initialized apart, then ``weight_qkv`` REBUILT as a new Parameter (no TP attributes)."""
        with torch.no_grad():
            parts = [torch.empty(n, self.weight_qkv.shape[1], dtype=self.weight_qkv.dtype) for n in self.sizes]
            for part in parts:
                self.init_method(part)
            self.weight_qkv = nn.Parameter(torch.cat(parts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(F.linear(x, self.weight_qkv).split(self.sizes, dim=-1))


def parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """FAKE ``parallel_cross_entropy``: per-token loss, no reduction, no ignore_index (as NxD's)."""
    V = vocab_parallel_logits.shape[-1]
    flat = F.cross_entropy(
        vocab_parallel_logits.reshape(-1, V),
        target.reshape(-1).clamp_min(0),
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return flat.view(target.shape)


FAKE_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding, GQAQKVColumnParallelLinear)


# --- model, optimizer, pipeline ---------------------------------------------------------------------------------------


class FakeNxDModel(nn.Module):
    """FAKE ``trainer.model.NxDModel``: no name prefix; ``run_train`` runs the pipeline's micro-batches in-process."""

    def __init__(self, module: nn.Module, nxd_config: dict, api: FakeNeuronApi) -> None:
        super().__init__()
        self.module, self.nxd_config, self._api = module, nxd_config, api
        self.pp_enabled = nxd_config["pipeline_parallel_size"] > 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any):
        yield from self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)

    def local_modules(self) -> list[nn.Module]:
        return [self.module]

    def original_module(self) -> nn.Module:
        return self.module

    def run_train(self, **kwargs: torch.Tensor) -> torch.Tensor:
        self._api.record("NxDModel.run_train", **kwargs)
        if not self.pp_enabled:
            loss = self.forward(**kwargs)
            loss.backward()
            return loss
        pipe = self.nxd_config["pipeline_config"]
        n = pipe["num_microbatches"]
        if set(kwargs) != set(pipe["input_names"]):
            raise RuntimeError(f"train inputs {set(kwargs)} must be the tracing input names {pipe['input_names']}")
        for name, t in kwargs.items():
            if t.device != torch.device("cpu"):
                raise ValueError(f"model inputs should be all on cpu device, but getting {name} on {t.device}")
            if t.shape[0] % n:
                raise RuntimeError(f"Input batch size {t.shape[0]} must be divisible with the num_microbatches {n}")
        losses = []
        for k in range(n):
            mb = {name: t.chunk(n)[k] for name, t in kwargs.items()}
            loss = self.module(**mb)
            (loss / n).backward()  # as NxD's Train1F1BSchedule
            losses.append(loss.detach())
        return torch.stack(losses).sum() / n  # broadcast_and_average_loss: the same value on every rank


class FakeNxDOptimizer(torch.optim.Optimizer):
    """FAKE ``trainer.optimizer.NxDOptimizer``: clips inside ``step()``; ``grad_norm`` is the pre-clip norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, nxd_config: dict, api: FakeNeuronApi) -> None:
        self.optimizer, self.nxd_config, self._api = optimizer, nxd_config, api
        self.grad_norm: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self._api.record("NxDOptimizer.step")
        cfg = self.nxd_config["optimizer_config"]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if cfg["grad_clipping"]:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["max_grad_norm"])
        self.optimizer.step()


@contextmanager
def _parameters_on_meta():
    """NxD's ``init_on_device(meta)`` without buffers: parameters are created on the meta device."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _reinit(model: nn.Module, param_init_fn: Callable) -> None:
    """NxD's ``reinit_model``: each module's own parameters become empty host tensors, then ``param_init_fn``."""
    keep = {
        n: p.sequence_parallel_enabled for n, p in model.named_parameters() if hasattr(p, "sequence_parallel_enabled")
    }
    with torch.no_grad():
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:  # NaN: whatever param_init_fn forgets shows
                    module._parameters[key] = nn.Parameter(torch.full_like(p, math.nan, device="cpu"), p.requires_grad)
            param_init_fn(module, torch.device("cpu"))
    for n, p in model.named_parameters():  # NxD's preserve_parallel_attributes
        if n in keep:
            p.sequence_parallel_enabled = keep[n]


class _CheckpointWrapper(CheckpointWrapper):
    """NxD's ``NxDCheckpointWrapper``: torch's checkpoint wrapper, whose ``named_modules`` drop the wrapper's prefix.

    (NxD recomputes with torch_xla's reentrant checkpoint; the fake with torch's non-reentrant one, on the CPU.)
    """

    def named_modules(self, *args: Any, **kwargs: Any):
        for name, module in super().named_modules(*args, **kwargs):
            yield name.replace(_CHECKPOINT_PREFIX, ""), module


def _wrap_children(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> None:
    """NxD's ``apply_activation_checkpointing``: every module of ``classes`` below ``model`` in a checkpoint wrapper."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, classes):
                setattr(parent, name, _CheckpointWrapper(child))


class _TorchTracer(torch.fx.Tracer):
    """NxD's ``TorchTracerWrapper``: leaf modules by class-name substring, plus the parallel layers."""

    def __init__(self, leaves: list[str]) -> None:
        super().__init__(param_shapes_constant=True)
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return any(t in type(m).__name__ for t in self.leaves) or super().is_leaf_module(m, qualified_name)


def trace_like_nxd(model: nn.Module, pipe: dict) -> torch.fx.GraphModule:
    """Trace as ``NxDPPModel`` does with ``tracer_cls="torch"`` (the transformer layer class is a leaf)."""
    leaves = [
        *(pipe.get("leaf_module_cls") or []),
        pipe["transformer_layer_cls"].__name__,
        *(c.__name__ for c in FAKE_LAYERS),
    ]
    sig = inspect.signature(model.forward)
    concrete = {p.name: p.default for p in sig.parameters.values() if p.name not in pipe["input_names"]}
    graph = _TorchTracer(leaves).trace(model, concrete_args=concrete)
    return torch.fx.GraphModule(model, graph)


# --- the fake API itself --------------------------------------------------------------------------------------------


class FakeNeuronApi:
    """The recording fake: modules, state, and the list of calls."""

    def __init__(self, world_size: int = 1) -> None:
        self.calls: list[Call] = []
        self.world_size = world_size
        self.closures: list[tuple[Callable, tuple]] = []
        self.traced: torch.fx.GraphModule | None = None
        self.finder = _Finder(self)

    # recording
    def record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Call(name, args, kwargs))

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def first(self, name: str) -> Call:
        return next(c for c in self.calls if c.name == name)

    def all(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def index(self, name: str) -> int:
        return self.names().index(name)

    # installation
    def install(self, monkeypatch: Any) -> FakeNeuronApi:
        """Serve the fake modules to ``import`` (until ``uninstall``) and fake ``dist.init_process_group``."""
        monkeypatch.setattr(sys, "meta_path", [self.finder, *sys.meta_path])
        monkeypatch.setattr(torch.distributed, "init_process_group", self.init_process_group)
        monkeypatch.setattr(_Recorded, "api", self)
        return self

    def unload(self) -> None:
        """Forget the imported fake modules, as a new process would (the finder stays installed)."""
        for name in [m for m in sys.modules if m.split(".")[0] in FAKE_PACKAGES]:
            del sys.modules[name]

    # torch.distributed / torch_xla
    def init_process_group(self, backend: str | None = None, **kwargs: Any) -> None:
        self.record("dist.init_process_group", backend, **kwargs)

    def xla_device(self) -> torch.device:
        self.record("xm.xla_device")
        return torch.device("cpu")

    def mark_step(self) -> None:
        self.record("xm.mark_step")
        self._run_closures()

    def device(self, index: int | None = None) -> torch.device:
        self.record("torch_xla.device")
        return torch.device("cpu")

    def sync(self, wait: bool = False, reset_scope: bool = True) -> None:
        self.record("torch_xla.sync")
        self._run_closures()

    def _run_closures(self) -> None:
        closures, self.closures = self.closures, []
        for fn, args in closures:
            fn(*args)

    def wait_device_ops(self, devices: list | None = None) -> None:
        self.record("xm.wait_device_ops")

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        self.record("xm.add_step_closure", fn, args)
        self.closures.append((fn, args))

    def all_reduce(
        self, reduce_type: str, inputs: torch.Tensor, scale: float = 1.0, groups: Any = None, pin_layout: bool = True
    ) -> torch.Tensor:
        self.record("xm.all_reduce", reduce_type, inputs, groups=groups)
        assert reduce_type == "sum"
        return inputs * self.world_size * scale  # every rank holds the same value

    def rendezvous(self, tag: str) -> None:
        self.record("xm.rendezvous", tag)

    # neuronx_distributed
    def neuronx_distributed_config(
        self,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        expert_parallel_size=1,
        context_parallel_size=1,
        pipeline_config=None,
        optimizer_config=None,
        activation_checkpoint_config=None,
        pad_model=False,
        sequence_parallel=False,
        model_init_config=None,
        lora_config=None,
        mixed_precision_config=None,
        sequential_move_factor=11,
        lnc_size=1,
    ) -> dict:
        args = dict(locals())
        del args["self"]
        self.record("neuronx_distributed_config", **args)
        if model_init_config and model_init_config.get("meta_device_init") and "param_init_fn" not in model_init_config:
            raise ValueError("param_init_fn must be provided when meta_device_init is True")
        return args

    def initialize_parallel_model(
        self, nxd_config: dict, model_fn: Callable, include_buffers: bool = False, *model_args: Any, **model_kwargs: Any
    ) -> FakeNxDModel:
        self.record("initialize_parallel_model", nxd_config, model_fn, include_buffers, *model_args, **model_kwargs)
        init = nxd_config["model_init_config"]
        if init["meta_device_init"]:
            with _parameters_on_meta():
                model = model_fn(*model_args, **model_kwargs)
        else:
            model = model_fn(*model_args, **model_kwargs)
        if nxd_config["pipeline_parallel_size"] > 1:
            pipe = nxd_config["pipeline_config"]
            _signature(_sig_nxdpp).bind(model, **pipe)  # only NxDPPModel's arguments
            if pipe.get("tracer_cls") not in (None, "torch", "hf"):
                raise ValueError(f"Unsupported tracer_cls {pipe['tracer_cls']}")
            self.traced = trace_like_nxd(model, pipe)  # on the meta device, before materialization, as NxD
        if init["meta_device_init"]:
            _reinit(model, init["param_init_fn"])
        model.to(torch.device("cpu"))
        ac, pp = nxd_config["activation_checkpoint_config"], nxd_config["pipeline_parallel_size"] > 1
        if ac == "full" and not pp:
            raise RuntimeError(
                '`activation_checkpoint_config` "full" is only supported for huggingface transformers or nxdt models.'
            )
        if ac is not None:  # with PP NxD wraps the transformer layers, whatever the classes
            classes = tuple(ac) if isinstance(ac, (list, tuple)) else (ac,)
            _wrap_children(model, (nxd_config["pipeline_config"]["transformer_layer_cls"],) if pp else classes)
        return FakeNxDModel(model, nxd_config, self)

    def initialize_parallel_optimizer(
        self, nxd_config: dict, optimizer_class: type, parameters: Any, **defaults: Any
    ) -> FakeNxDOptimizer:
        self.record("initialize_parallel_optimizer", nxd_config, optimizer_class, parameters, **defaults)
        opt, mp = nxd_config["optimizer_config"], nxd_config["mixed_precision_config"]
        if not opt["zero_one_enabled"]:
            if mp["use_master_weights"]:
                raise RuntimeError("ZeRO-1 optimizer is not enabled, while `use_master_weights` is True.")
            if mp["use_fp32_grad_acc"] or mp["use_master_weights_in_ckpt"]:
                raise RuntimeError(
                    "Non Zero-1 optimizer does not support `use_fp32_grad_acc` of `use_master_weights_in_ckpt`."
                )
        return FakeNxDOptimizer(optimizer_class(parameters, **defaults), nxd_config, self)

    def save_checkpoint(
        self,
        checkpoint_dir_str,
        tag,
        model=None,
        optimizer=None,
        scheduler=None,
        user_content=None,
        num_workers=8,
        use_xser=False,
        num_kept_ckpts=None,
        async_save=False,
        zero1_optimizer=False,
        use_zero1_dcp=False,
        avoid_saving_lower_precision_weights=False,
    ) -> None:
        args = dict(locals())
        del args["self"]
        self.record("save_checkpoint", **args)
        d = Path(checkpoint_dir_str) / tag
        (d / "model").mkdir(parents=True, exist_ok=True)
        (d / "optim").mkdir(exist_ok=True)
        (d / "checkpoint").write_text("1")
        torch.save(model.state_dict(), d / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        torch.save(optimizer.state_dict(), d / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        if user_content is not None:
            torch.save(user_content, d / "user_content.pt")
        self.rendezvous("saving checkpoint done")
        (d / "done").write_text("1")

    def load_checkpoint(
        self,
        path,
        tag=None,
        model=None,
        optimizer=None,
        scheduler=None,
        num_workers=8,
        strict=True,
        use_zero1_dcp=False,
    ) -> Any:
        args = dict(locals())
        del args["self"]
        self.record("load_checkpoint", **args)
        d = Path(path) / tag
        model.load_state_dict(torch.load(d / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"), strict=strict)
        optimizer.load_state_dict(torch.load(d / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        uc = d / "user_content.pt"
        return torch.load(uc, weights_only=False) if uc.exists() else None

    def finalize_checkpoint(self) -> None:
        self.record("finalize_checkpoint")

    def model_parallel_xla_manual_seed(self, seed: int) -> None:
        self.record("model_parallel_xla_manual_seed", seed)

    # the modules
    def build(self, module: ModuleType) -> None:
        """Fill the fake module ``module`` (called by the finder on import)."""
        fill: dict[str, dict[str, Any]] = {
            "torch_xla": {"device": self.device, "sync": self.sync},
            "torch_xla.core": {},
            "torch_xla.core.xla_model": {
                "REDUCE_SUM": "sum",
                "xla_device": self.xla_device,
                "mark_step": self.mark_step,
                "add_step_closure": self.add_step_closure,
                "all_reduce": self.all_reduce,
                "rendezvous": self.rendezvous,
                "wait_device_ops": self.wait_device_ops,
            },
            "torch_xla.distributed": {},
            "torch_xla.distributed.xla_backend": {},
            "torch_xla.debug": {},
            "torch_xla.debug.metrics": {  # no compile counted: the fake traces no graphs
                "counter_value": lambda name: None,
                "metric_data": lambda name: None,
                "counter_names": lambda: [],
            },
            "neuronx_distributed": {
                "neuronx_distributed_config": self.neuronx_distributed_config,
                "initialize_parallel_model": self.initialize_parallel_model,
                "initialize_parallel_optimizer": self.initialize_parallel_optimizer,
                "save_checkpoint": self.save_checkpoint,
                "load_checkpoint": self.load_checkpoint,
                "finalize_checkpoint": self.finalize_checkpoint,
            },
            "neuronx_distributed.parallel_layers": {
                "ColumnParallelLinear": ColumnParallelLinear,
                "RowParallelLinear": RowParallelLinear,
                "ParallelEmbedding": ParallelEmbedding,
                "parallel_cross_entropy": parallel_cross_entropy,
                "model_parallel_xla_manual_seed": self.model_parallel_xla_manual_seed,
            },
            "neuronx_distributed.modules": {},
            "neuronx_distributed.modules.qkv_linear": {"GQAQKVColumnParallelLinear": GQAQKVColumnParallelLinear},
        }
        self.record(f"import {module.__name__}", env={k: os.environ.get(k) for k in WATCHED_ENV})
        module.__dict__.update(fill[module.__name__])
        module.__doc__ = "FAKE module from tests/fakes/neuron_api.py"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the fake modules to ``import`` while installed on ``sys.meta_path``."""

    MODULES = (
        "torch_xla",
        "torch_xla.core",
        "torch_xla.core.xla_model",
        "torch_xla.distributed",
        "torch_xla.distributed.xla_backend",
        "torch_xla.debug",
        "torch_xla.debug.metrics",
        "neuronx_distributed",
        "neuronx_distributed.parallel_layers",
        "neuronx_distributed.modules",
        "neuronx_distributed.modules.qkv_linear",
    )

    def __init__(self, api: FakeNeuronApi) -> None:
        self.api = api

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self.MODULES:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        self.api.build(module)
