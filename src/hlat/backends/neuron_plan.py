"""What a run config becomes on Trainium, as pure functions: environment, precision, NxD config, checkpoint calls.

Imports no ``torch_xla`` / ``neuronx_distributed`` (only ``hlat.backends.neuron`` does), so the mapping is tested
exactly on any machine and the launch renderer exports ``neuron_env``. Names and values come from NxD 0.17's code and
Llama examples (github.com/aws-neuron/neuronx-distributed, tag v2.28.0), the Neuron SDK docs and HLAT's scripts
(github.com/awslabs/HLAT); the precision modes are tabled in docs/precision.md. None of this has run on a trn1 host.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hlat.backends.neuron_model import NeuronAttentionCore, NeuronBlock, NeuronModelOptions, NeuronRMSNorm, TokenLoss
from hlat.config import ParallelismConfig, PrecisionConfig, RunConfig
from hlat.layouts import check_neuron_precision
from hlat.layouts import check_neuron_supported as check_supported
from hlat.parallel import ParallelDims

XLA_MODULES = ("torch_xla", "torch_neuronx", "neuronx_distributed")

COMPILER_FLAGS = ("--model-type transformer", "--distribution-strategy=llm-training")
"""HLAT's neuronx-cc flags (paper §3.5, HLAT's scripts). NxDT drops ``llm-training`` with NKI flash attention;
the neuron backend runs its own attention core (``NeuronAttentionCore``), never the NKI kernel, so it stays on."""
INFLIGHT_REQUESTS = 3
"""``NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS`` without pipeline parallelism: HLAT-7B's value (paper §3.5)."""
INFLIGHT_REQUESTS_PP = 31
"""The same with pipeline parallelism: HLAT's own 70B script. The pipeline schedule issues many small
graphs per step (a forward, a backward, sends and receives per micro-batch), so a deep queue keeps the cores fed;
NxD's 70B example uses 7 and NxDT 5, which cost less device memory if 31 ever runs short."""
MALLOC_ARENAS, MALLOC_ARENAS_PP = 64, 128
"""``MALLOC_ARENA_MAX`` for HLAT's 7B and 70B scripts: fewer glibc arenas, no host OOM. glibc reads
it at process start, so it only works exported by the launcher; setting it in-process changes nothing."""
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
"""libfabric over EFA for multi-node collectives (HLAT's scripts)."""
SEQUENTIAL_MOVE_FACTOR = 11
"""Ranks per host that materialize their model shard at once (NxD's default, "works for 20B"; ``trainer.py``)."""
RECOMPUTED: dict[str, type[torch.nn.Module] | None] = {
    "none": None,
    "full": NeuronBlock,
    "selective": NeuronAttentionCore,
}
"""``activation_checkpoint_config`` per ``parallelism.activation_checkpointing``: NxD wraps each module of the class in
its checkpoint wrapper (names unchanged), with PP the blocks whatever the class. ``full`` is the block class, not the
string ``"full"``, which NxD resolves only for Hugging Face and NxDT models, or with PP."""


@dataclass(frozen=True)
class NeuronPrecision:
    """What a precision config becomes on Trainium."""

    env: dict[str, str]
    """Variables to set before torch_xla is imported (``apply_env``)."""
    cc_flags: tuple[str, ...]
    """neuronx-cc flags to append to ``NEURON_CC_FLAGS`` (NxDT adds the same ones per precision type)."""
    mixed_precision_config: dict[str, bool]
    """``neuronx_distributed_config(mixed_precision_config=...)``."""
    autocast: bool
    """Wrap forward in ``torch.autocast("xla", dtype=torch.bfloat16)`` (fp32 parameters, bf16 matmuls)."""
    upcast_dtype: str
    """The dtype model code casts to for an fp32 operation: float64 under XLA_DOWNCAST_BF16 (mapped to fp32)."""
    reduce_dtype: str
    """``reduce_dtype`` of the ColumnParallelLinear / RowParallelLinear / GQAQKV layers (tensor-parallel sums)."""
    notes: list[str] = field(default_factory=list)
    """Human-readable lines for the run log."""


def precision_plan(p: PrecisionConfig, par: ParallelismConfig, seed: int) -> NeuronPrecision:
    """Map ``precision`` (with ``parallelism.zero1``) onto Neuron env vars, compiler flags and NxD config.

    Args:
        p: The precision config.
        par: The parallelism config (only ``zero1`` matters here).
        seed: train.seed, which seeds the hardware's stochastic rounding.

    Returns:
        The Neuron settings.

    Raises:
        ConfigError: for a combination NxD or torch-xla cannot honour, naming the keys and the fix.
    """
    check_neuron_precision(p, par)  # hlat.layouts: what hlat launch and the planner's advice ask too
    low = p.param_dtype == "bfloat16"
    env = {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if p.stochastic_rounding else "0"}
    if p.stochastic_rounding:
        env["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] = str(seed)
    if low:
        env["XLA_DOWNCAST_BF16" if p.master_weights else "XLA_USE_BF16"] = "1"
    autocast = not low and p.compute_dtype == "bfloat16"
    if not low:
        flags: tuple[str, ...] = ("--auto-cast=none",)  # torch decides the dtypes, not the compiler
        if autocast:
            flags += ("--enable-mixed-precision-accumulation",)
    else:
        flags = ("--enable-mixed-precision-accumulation",)
    return NeuronPrecision(
        env=env,
        cc_flags=flags,
        mixed_precision_config={
            "use_master_weights": p.master_weights,
            "use_fp32_grad_acc": low and p.fp32_grad_accum,
            # The fp32 masters go into checkpoints, so a resume (every automatic restart) continues from them
            # instead of re-widening the rounded bf16 weights, as the torch backend's PrecisionAdamW state does.
            "use_master_weights_in_ckpt": p.master_weights,
        },
        autocast=autocast,
        upcast_dtype="float64" if (low and p.master_weights) else "float32",
        reduce_dtype="float32" if p.fp32_reduce else "bfloat16",
        notes=[f"precision={p.name}: " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))],
    )


def neuron_env(cfg: RunConfig) -> dict[str, str]:
    """Every environment variable a trn1 trainer process of this run needs, as strings.

    The launch renderer exports exactly this dict (Slurm, EKS, torchrun); ``NeuronBackend.setup`` applies it
    in-process with ``apply_env`` before torch_xla is imported. Contents (HLAT's scripts; paper §3.5, §4.3):
    ``NEURON_CC_FLAGS`` (``COMPILER_FLAGS`` and the precision's flags), ``NEURON_COMPILE_CACHE_URL``
    (``cluster.compile_cache``: local disk by default, not the shared FSx; alone, as HLAT's scripts set it: a
    ``--cache_dir`` in the flags would put the cache's location into the string the cache key's flags hash is taken
    of, so entries compiled into a staging cache and copied to each node's disk could miss; docs/trn1.md),
    ``NEURON_FUSE_SOFTMAX=1``,
    ``NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS`` (3, or 31 with pipeline parallelism), ``MALLOC_ARENA_MAX``
    (64, or 128 with pipeline parallelism), the precision variables of ``precision_plan``,
    ``XLA_DISABLE_FUNCTIONALIZATION=0`` with ZeRO-1 (NxD's scripts: needed for ZeRO-1 convergence; also torch-xla's
    default), ``PJRT_DEVICE`` where ``cluster.pjrt_device`` is not ``NEURON`` (``cluster=xla_cpu``),
    ``NXD_CPU_MODE=1`` with ``cluster.nxd_cpu_mode`` (``cluster=nxd_cpu``) and, on more than one node with EFA
    devices, ``EFA_ENV``.

    Raises:
        ConfigError: for a precision x parallelism combination or a setting the backend cannot honour.
    """
    check_supported(cfg)
    c, par = cfg.cluster, cfg.parallelism
    plan = precision_plan(cfg.precision, par, cfg.train.seed)
    pp = par.pp > 1
    env = {
        "NEURON_CC_FLAGS": " ".join((*COMPILER_FLAGS, *plan.cc_flags)),
        "NEURON_COMPILE_CACHE_URL": c.compile_cache,
        "NEURON_FUSE_SOFTMAX": "1",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": str(INFLIGHT_REQUESTS_PP if pp else INFLIGHT_REQUESTS),
        "MALLOC_ARENA_MAX": str(MALLOC_ARENAS_PP if pp else MALLOC_ARENAS),
        **plan.env,
    }
    if c.pjrt_device != "NEURON":  # cluster=xla_cpu; on trn1 the Neuron image sets PJRT_DEVICE=NEURON itself
        env["PJRT_DEVICE"] = c.pjrt_device
    if c.nxd_cpu_mode:  # cluster=nxd_cpu: NxD on CPU tensors over gloo
        env["NXD_CPU_MODE"] = "1"
    if par.zero1:
        env["XLA_DISABLE_FUNCTIONALIZATION"] = "0"
    if c.nodes > 1 and c.efa_devices > 0:
        env.update(EFA_ENV)
    return env


def pipeline_config(par: ParallelismConfig, num_microbatches: int) -> dict[str, Any]:
    """``NxDPPModel`` keyword arguments (NxD's ``pipeline/model.py``) for the decoder of ``hlat.backends.neuron_model``.

    The model is traced with torch.fx (``tracer_cls="torch"``: not a Hugging Face model) from its
    ``forward(input_ids, labels)``, with blocks (NxD's default for ``transformer_layer_cls``), norms and the loss as
    leaves, and cut evenly between blocks (``auto_partition``). Given labels the forward returns the loss alone
    (``output_loss_value_spec=True``); NxD scales each micro-batch's loss by 1/num_microbatches, and
    ``broadcast_and_average_loss`` (as HLAT's 70B script) hands every rank the loss averaged over data parallelism.
    """
    return {
        "transformer_layer_cls": NeuronBlock,
        "num_microbatches": num_microbatches,
        "output_loss_value_spec": True,
        "input_names": ["input_ids", "labels"],
        "auto_partition": True,
        "leaf_module_cls": [NeuronRMSNorm.__name__, TokenLoss.__name__],
        "tracer_cls": "torch",
        "use_zero1_optimizer": par.zero1,
        "use_optimizer_wrapper": True,
        "broadcast_and_average_loss": True,
    }


def nxd_config_kwargs(
    cfg: RunConfig, *, param_init_fn: Callable[..., None], world_size: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.neuronx_distributed_config`` for this run (NxD's ``trainer.py``).

    Tensor and pipeline degrees, sequence parallelism, the optimizer (ZeRO-1; clipping is always on because NxD
    computes ``grad_norm`` only when it clips: ``optimizer.clip_grad_norm=0`` becomes an infinite limit), recompute
    (``RECOMPUTED``), the precision's ``mixed_precision_config``, and meta-device init with ``param_init_fn``
    (``neuron_model.ModuleInit``). With pipeline parallelism, ``pipeline_config`` with one micro-batch per
    gradient-accumulation step.

    Args:
        cfg: The run config.
        param_init_fn: NxD's ``param_init_fn(module, device)``.
        world_size: Ranks in the job; defaults to ``cluster.nodes x cluster.nproc_per_node``.
    """
    par, clip = cfg.parallelism, cfg.optimizer.clip_grad_norm
    dims = ParallelDims.build(par, world_size or cfg.cluster.world_size, cfg.model, cfg.train)
    plan = precision_plan(cfg.precision, par, cfg.train.seed)
    optimizer = {"zero_one_enabled": par.zero1, "grad_clipping": True, "max_grad_norm": clip if clip > 0 else math.inf}
    init = {"sequential_move_factor": SEQUENTIAL_MOVE_FACTOR, "meta_device_init": True, "param_init_fn": param_init_fn}
    return {
        "tensor_parallel_size": par.tp,
        "pipeline_parallel_size": par.pp,
        "pipeline_config": pipeline_config(par, dims.grad_accum(cfg.train)) if par.pp > 1 else None,
        "optimizer_config": optimizer,
        "activation_checkpoint_config": RECOMPUTED[par.activation_checkpointing],
        "sequence_parallel": par.sequence_parallel,
        "model_init_config": init,
        "mixed_precision_config": plan.mixed_precision_config,
    }


def model_options(cfg: RunConfig, world_size: int | None = None) -> NeuronModelOptions:
    """The layout and dtypes of this run's ``neuron_model.NeuronTransformer``."""
    par = cfg.parallelism
    dims = ParallelDims.build(par, world_size or cfg.cluster.world_size, cfg.model, cfg.train)
    plan = precision_plan(cfg.precision, par, cfg.train.seed)
    return NeuronModelOptions(
        sequence_parallel=par.sequence_parallel,
        kv_size_multiplier=dims.kv_replicas(cfg.model),
        reduce_dtype=getattr(torch, plan.reduce_dtype),
        upcast_dtype=getattr(torch, plan.upcast_dtype),
        fp32_softmax_ce=cfg.precision.fp32_softmax_ce,
        seed=cfg.train.seed,
    )


def apply_env(env: dict[str, str]) -> None:
    """Export ``env`` into this process; refuses once torch_xla is imported, because it reads them at import.

    Raises:
        RuntimeError: if a Neuron/XLA module is already imported.
    """
    loaded = [m for m in XLA_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(
            f"{', '.join(loaded)} already imported: precision variables {sorted(env)} must be set before torch_xla "
            "is imported (it reads XLA_USE_BF16 / XLA_DOWNCAST_BF16 once); set them at process start"
        )
    os.environ.update(env)


def checkpoint_calls(path: Path, extra: dict[str, Any], *, async_save: bool, zero1: bool) -> tuple[dict, dict]:
    """Keyword arguments of ``nxd.save_checkpoint`` and ``nxd.load_checkpoint`` for one hlat checkpoint directory.

    ``hlat.checkpoint`` keeps owning atomicity and retention (the ``.tmp`` directory, manifest with checksums,
    keep_last / keep_every), so NxD writes into ``path`` as one tag and prunes nothing (``num_kept_ckpts=None``).
    xser serialization writes one tensor at a time (no host OOM at 70B; NxD's ``checkpoint.py``); loader position, train
    state and RNG travel in ``user_content``. ``async_save`` uses NxD's own thread pool, which
    ``nxd.finalize_checkpoint()`` waits for. Not run on trn1 yet.
    """
    save = {
        "checkpoint_dir_str": str(path.parent),
        "tag": path.name,
        "user_content": extra,
        "use_xser": True,
        "async_save": async_save,
        "num_kept_ckpts": None,
        "zero1_optimizer": zero1,
    }
    load = {"path": str(path.parent), "tag": path.name}
    return save, load
