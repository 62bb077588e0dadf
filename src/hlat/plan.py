"""Pre-flight memory estimate: refuse a run that cannot fit before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from hlat.config import ClusterConfig, ConfigError, RunConfig
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
    """Parameter count and a per-rank memory estimate for training ``cfg``.

    Bytes per parameter come from the precision mode (``hlat.precision.bytes_per_param``). Weights and gradients
    are sharded by tp*pp; AdamW's moments and the master copy by tp*pp, and also by dp with ZeRO-1. Activations:
    ``activation_bytes``, plus the fp32 logits and their gradient (the cross-entropy keeps both), split over tp.
    """
    m, t = cfg.model, cfg.train
    n = count_params(m)
    shard = dims.tp * dims.pp
    bpp = bytes_per_param(cfg.precision)
    opt_shard = shard * (dims.dp if cfg.parallelism.zero1 else 1)
    logits = 2 * 4 * t.seq_len * t.micro_batch_size * m.vocab_size
    act = activation_bytes(cfg, dims) * BYTES[cfg.precision.compute_dtype] / 2
    est = MemoryEstimate(
        params=n * bpp.params // shard,
        grads=n * bpp.grads // shard,
        optimizer=n * (bpp.optimizer + bpp.master) // opt_shard,
        activations=int(act + logits / dims.tp),
    )
    return n, est


def activation_bytes(cfg: RunConfig, dims: ParallelDims) -> float:
    """Bytes of activations one rank keeps for backward, at 16-bit, after Korthikanti et al. (2022), Table 2.

    Per layer and micro-batch of s tokens x b sequences, width h, a heads, tensor-parallel degree t:
    s*b*h*(34 + 5*a*s/h)/t with sequence parallelism (or t=1), s*b*h*(10 + (24 + 5*a*s/h)/t) without it. The
    5*a*s/h term is the attention core's (scores, softmax, dropout mask): selective checkpointing recomputes it, so
    it is dropped; full checkpointing keeps only each layer's input (2*s*b*h, split by SP) plus one layer's working
    set during its recomputation. With pipeline parallelism each stage holds L/pp layers, and 1F1B keeps up to pp
    micro-batches in flight on the first stage, so pp does not divide the total (Korthikanti §4.2.3).

    The attention term assumes the scores are materialized (XLA on Neuron without NKI flash attention); PyTorch's
    fused SDPA kernels keep only log-sum-exp statistics, so on the torch backend ``none`` over-counts.
    """
    m, t, par = cfg.model, cfg.train, cfg.parallelism
    s, b, h, a, tp = t.seq_len, t.micro_batch_size, m.dim, m.n_heads, dims.tp
    attn = 5 * a * s / h if par.activation_checkpointing == "none" else 0.0
    sp = par.sequence_parallel or tp == 1
    layer = s * b * h * (34 + attn) / tp if sp else s * b * h * (10 + (24 + attn) / tp)
    in_flight = min(dims.pp, dims.grad_accum(t)) if dims.pp > 1 else 1
    layers_held = m.n_layers / dims.pp * in_flight
    if par.activation_checkpointing == "full":
        return layers_held * 2 * s * b * h / (tp if sp else 1) + layer
    return layers_held * layer


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


def planned_budget(cluster: ClusterConfig) -> int:
    """Bytes one rank may use, for a dry run: ``cluster.device_memory_gib``, else this host's share of its memory."""
    if cluster.device_memory_gib is not None:
        free = int(cluster.device_memory_gib * GiB)
    elif cluster.device == "cuda" and torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        free = psutil.virtual_memory().available // cluster.nproc_per_node
    return int(free * cluster.memory_fraction)


def check_world(cluster: ClusterConfig, world_size: int) -> None:
    """A multi-node cluster preset must get all its ranks: a partial world would silently change the layout.

    (A one-node preset adapts to an external torchrun's ``--nproc-per-node``.)
    """
    if cluster.nodes > 1 and world_size != cluster.world_size:
        raise ConfigError(
            f"cluster={cluster.name} plans {cluster.nodes} nodes x {cluster.nproc_per_node} processes = "
            f"{cluster.world_size} ranks, but this job has {world_size}; start it on every node as "
            "`hlat launch` renders it, or set cluster.nodes to the nodes you have"
        )
