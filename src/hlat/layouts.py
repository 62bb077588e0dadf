"""What each backend runs, decided without importing it: one check for the trainer, ``hlat launch`` and the planner.

The backends call these same functions before they build anything, so a layout refused here is refused there.
Torch-free, so ``hlat plan`` stays a config-only command.
"""

from __future__ import annotations

from hlat.config import ConfigError, ModelConfig, ParallelismConfig, PrecisionConfig, RunConfig
from hlat.parallel import ParallelDims


def check_layout(cfg: RunConfig, dims: ParallelDims | None = None) -> ParallelDims:
    """Refuse a layout (default: the one ``cfg.cluster``'s world gets) that its backend cannot run; return it.

    Raises:
        ConfigError: the layout does not fit the world, or the backend does not run it.
    """
    if dims is None:
        dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    if cfg.cluster.backend == "torch":
        check_torch_layout(dims, cfg.model, cfg.precision)
    elif cfg.cluster.backend == "neuron":
        check_neuron_supported(cfg)
        check_neuron_precision(cfg.precision, cfg.parallelism)
    return dims


def check_torch_layout(dims: ParallelDims, model: ModelConfig, precision: PrecisionConfig) -> None:
    """Refuse a layout the torch backend does not implement yet (``TorchBackend.build_model``, before materializing).

    Raises:
        ConfigError: naming the degrees and what to use instead.
    """
    todo = []
    if dims.tp > model.kv_heads:
        todo.append(f"kv-head replication (parallelism.tp={dims.tp} > {model.kv_heads} kv heads)")
    if dims.pp > 1:
        todo.append(f"pipeline parallelism (parallelism.pp={dims.pp})")
    if todo:
        raise ConfigError(
            f"the torch backend does not implement {'; '.join(todo)} yet (the neuron backend is "
            "the target for these layouts); lower the degrees or use parallelism=single, dp or tp2"
        )
    if precision.param_dtype != "float32" and precision.fp32_grad_accum and dims.dp > 1 and dims.tp > 1:
        raise ConfigError(
            "precision.fp32_grad_accum=true with tensor and data parallelism together is not built on the torch "
            f"backend yet (precision={precision.name}, tp={dims.tp}, dp={dims.dp}): use precision=bf16_sr, tp=1 or "
            "dp=1"
        )


def check_neuron_supported(cfg: RunConfig) -> None:
    """Refuse the settings the neuron backend cannot honour (its ``setup`` calls this, before any compile).

    Raises:
        ConfigError: naming the key and the fix.
    """
    if cfg.train.on_nonfinite == "skip_step":
        raise ConfigError(
            "train.on_nonfinite=skip_step cannot be honoured on the neuron backend: NxD's optimizer all-reduces, "
            "clips and applies the update inside step(), before the gradient norm is known; use "
            "train.on_nonfinite=rollback (reload the last checkpoint, skip the batch) or halt"
        )
    par = cfg.parallelism
    if cfg.tracker.layer_grad_norms_every and (par.tp > 1 or par.pp > 1):
        raise ConfigError(
            f"tracker.layer_grad_norms_every={cfg.tracker.layer_grad_norms_every} with parallelism.tp={par.tp}, "
            f"pp={par.pp} on the neuron backend: each rank holds other shards and pipeline stages, so per-layer "
            "norms averaged over the ranks would be wrong; set tracker.layer_grad_norms_every=0 (train/grad_norm, "
            "NxD's global pre-clip norm, is logged anyway) or run with tp=1 and pp=1"
        )


def check_neuron_precision(p: PrecisionConfig, par: ParallelismConfig) -> None:
    """Refuse a precision that NxD or torch-xla cannot honour with ``par`` (``neuron_plan.precision_plan`` first).

    Raises:
        ConfigError: naming the keys and the fix.
    """
    low = p.param_dtype == "bfloat16"
    if p.bf16_matmul == "emulated":
        raise ConfigError(
            "precision.bf16_matmul=emulated is a torch-backend policy for CPUs without fast bf16 kernels; on the "
            "neuron backend bf16 matmuls are the hardware's (XLA_USE_BF16 / XLA_DOWNCAST_BF16): set "
            "precision.bf16_matmul=auto"
        )
    if p.master_weights and not par.zero1:
        raise ConfigError(
            f"precision={p.name} (master_weights=true) on the neuron backend needs parallelism.zero1=true: NxD keeps "
            "fp32 master weights inside its ZeRO-1 optimizer (without it neuronx_distributed raises 'Non Zero-1 "
            "optimizer does not support use_master_weights'); add parallelism.zero1=true"
        )
    if low and p.fp32_grad_accum and not par.zero1:
        raise ConfigError(
            f"precision.fp32_grad_accum=true with bf16 parameters (precision={p.name}) on the neuron backend needs "
            "parallelism.zero1=true (NxD's use_fp32_grad_acc lives in the ZeRO-1 optimizer); add "
            "parallelism.zero1=true or set precision.fp32_grad_accum=false"
        )
    if low and not p.master_weights:
        # XLA_USE_BF16: float and double both become bf16, so an "fp32" operation is impossible.
        for key in ("fp32_softmax_ce", "fp32_reduce"):
            if getattr(p, key):
                raise ConfigError(
                    f"precision.{key}=true cannot be honoured by precision={p.name} on the neuron backend: "
                    "XLA_USE_BF16=1 turns every float and double tensor into bf16; set "
                    f"precision.{key}=false or use precision=master_weights (XLA_DOWNCAST_BF16 keeps doubles in fp32)"
                )
