"""Pre-flight memory estimate: refuse a run that cannot fit before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config import ConfigError, RunConfig
from hlat.model import count_params
from hlat.parallel import ParallelDims
from hlat.precision import BYTES, bytes_per_param

GiB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by kind."""

    params: int
    grads: int
    optimizer: int
    """AdamW moments plus the fp32 master copy, when the precision mode keeps one."""
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def estimate_memory(cfg: RunConfig, dims: ParallelDims) -> tuple[int, MemoryEstimate]:
    """Parameter count and a per-rank memory estimate for training ``cfg`` without activation checkpointing.

    Bytes per parameter come from the precision mode (``hlat.precision.bytes_per_param``). Weights and gradients
    are sharded by tp*pp; AdamW's moments and the master copy by tp*pp, and also by dp with ZeRO-1. Activations
    follow Korthikanti et al. (2022) for one micro-batch, s*b*h*(34 + 5*a*s/h) bytes per layer at 16-bit, doubled
    for fp32, plus the fp32 logits and their gradient (the cross-entropy keeps both).
    """
    m, t = cfg.model, cfg.train
    n = count_params(m)
    shard = dims.tp * dims.pp
    bpp = bytes_per_param(cfg.precision)
    opt_shard = shard * (dims.dp if cfg.parallelism.zero1 else 1)
    a_scale = BYTES[cfg.precision.compute_dtype] / 2
    s, b, h, a = t.seq_len, t.micro_batch_size, m.dim, m.n_heads
    per_layer = s * b * h * (34 + 5 * a * s / h) * a_scale
    logits = 2 * 4 * s * b * m.vocab_size
    est = MemoryEstimate(
        params=n * bpp.params // shard,
        grads=n * bpp.grads // shard,
        optimizer=n * (bpp.optimizer + bpp.master) // opt_shard,
        activations=int(per_layer * m.n_layers / (dims.tp * dims.pp) + logits / dims.tp),
    )
    return n, est


def check_fits(est: MemoryEstimate, budget_bytes: int, cfg: RunConfig) -> None:
    """Raise a ConfigError naming what to change when the estimate exceeds the device budget."""
    if est.total <= budget_bytes:
        return
    raise ConfigError(
        f"model={cfg.model.name} needs about {est.total / GiB:.1f} GiB per rank "
        f"(weights {est.params / GiB:.1f}, grads {est.grads / GiB:.1f}, AdamW state {est.optimizer / GiB:.1f}, "
        f"activations {est.activations / GiB:.1f}; precision={cfg.precision.name} keeps "
        f"{bytes_per_param(cfg.precision).total} bytes per parameter) "
        f"but this device offers {budget_bytes / GiB:.1f} GiB "
        f"(cluster.memory_fraction={cfg.cluster.memory_fraction} of free memory). Use a smaller model "
        "(model=tiny or model=small), a smaller train.micro_batch_size / train.seq_len, or a cluster with "
        "more devices; `train.dry_run=true` prints the estimate without training."
    )
