"""Pre-flight memory estimate: refuse a run that cannot fit before anything is allocated, and name the fix.

The step-time side of the planner is ``hlat.plan.step_model``; ``hlat plan`` (``hlat.plan.report``) prints both.
Torch-free: imports ``hlat.config``, the core and ``hlat.plan.clusters`` (the presets the advice may propose).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hlat.config import ClusterConfig, ConfigError, ModelConfig, RunConfig
from hlat.parallel import ParallelDims, valid_tp
from hlat.plan.clusters import can_add_nodes, cluster_presets
from hlat.sizing import BYTES, bytes_per_param, count_params  # torch-free: `hlat plan` / `hlat summary` start fast

log = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by kind."""

    params: int
    grads: int
    optimizer: int
    """AdamW moments plus the fp32 master copy, when the precision mode keeps one."""
    activations: int
    master: int = 0
    """The part of ``optimizer`` that is the fp32 master copy (already counted there)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def estimate_memory(cfg: RunConfig, dims: ParallelDims) -> tuple[int, MemoryEstimate]:
    """Parameter count and a per-rank memory estimate for training ``cfg``.

    Bytes per parameter come from the precision mode (``hlat.sizing.bytes_per_param``). Weights and gradients
    are sharded by tp*pp; AdamW's moments and the master copy by tp*pp, and also by dp with ZeRO-1. Activations:
    ``activation_bytes``, plus the fp32 logits and their gradient (the cross-entropy keeps both), split over tp.
    """
    m, t = cfg.model, cfg.train
    n = param_count(m)
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
        master=n * bpp.master // opt_shard,
    )
    return n, est


_PARAM_COUNTS: dict[tuple, int] = {}


def param_count(model: ModelConfig) -> int:
    """``hlat.sizing.count_params``, remembered per architecture (the planner asks for the same one many times).

    Arithmetic, equal to building the model on the meta device (``hlat.model.count_params``; tests/unit/test_model.py).
    """
    key = dataclasses.astuple(model)
    if key not in _PARAM_COUNTS:
        _PARAM_COUNTS[key] = count_params(model)
    return _PARAM_COUNTS[key]


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


def check_fits(est: MemoryEstimate, budget_bytes: int, cfg: RunConfig, *, dims: ParallelDims | None = None) -> None:
    """Raise a ConfigError naming what to change when the estimate exceeds the device budget.

    The message suggests the first changes, in order of cost, that the estimate predicts to fit and that the
    backend and launch path of ``cfg.cluster`` can run (``suggest_fixes``); when there are none, the smallest
    cluster preset predicted to fit (``cluster_fix``). ``dims`` is the run's layout; without it, the one
    ``cfg.cluster`` plans. A layout the backend cannot run at all is refused as such first
    (``hlat.layouts.check_layout``): advice built on top of it would not run either.
    """
    if est.total <= budget_bytes:
        return
    from hlat.layouts import check_layout

    if dims is None:
        try:
            dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
        except ConfigError:
            dims = None  # the cluster's world does not fit the layout: no advice
    if dims is not None:
        check_layout(cfg, dims)  # a layout the backend refuses: that, not the estimate, is the problem
    fixes = suggest_fixes(cfg, dims, budget_bytes) if dims is not None else []
    fix = (
        "Use a smaller model (model=tiny or model=small), a smaller train.micro_batch_size / train.seq_len, "
        "or a cluster with more devices."
    )
    if fixes:
        shown = " or ".join(f"`{' '.join(f.overrides)}` (~{f.memory.total / GiB:.1f} GiB)" for f in fixes)
        launch = (
            " (more nodes: start every node with what `hlat launch` renders)"
            if any("cluster.nodes=" in o for f in fixes for o in f.overrides)
            else ""
        )
        fix = (
            f"The planner predicts these would fit: {shown}{launch} (`hlat plan` with the same overrides shows "
            f"the breakdown). Otherwise: {fix[0].lower()}{fix[1:]}"
        )
    elif dims is not None:
        fix = f"{': '.join(nothing_fits(cfg, cluster_fix(cfg)))}. Otherwise: {fix[0].lower()}{fix[1:]}"
    raise ConfigError(
        f"model={cfg.model.name} needs about {est.total / GiB:.1f} GiB per rank "
        f"(weights {est.params / GiB:.1f}, grads {est.grads / GiB:.1f}, AdamW state {est.optimizer / GiB:.1f}, "
        f"activations {est.activations / GiB:.1f}; precision={cfg.precision.name} keeps "
        f"{bytes_per_param(cfg.precision).total} bytes per parameter) "
        f"but this device offers {budget_bytes / GiB:.1f} GiB "
        f"(cluster.memory_fraction={cfg.cluster.memory_fraction} of free memory). {fix} These are estimates (runtime "
        "buffers and fragmentation are not counted); `train.dry_run=true` prints one without training."
    )


@dataclass(frozen=True)
class Fix:
    """A change of the config that the memory estimate predicts to fit."""

    overrides: tuple[str, ...]
    """Hydra overrides, as for ``python train.py``."""
    memory: MemoryEstimate
    dims: ParallelDims


def with_changes(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """``cfg`` with ``{"group.field": value}`` replaced, validated again (every ``__post_init__``)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        group, name = key.split(".")
        groups.setdefault(group, {})[name] = value
    return dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **kw) for g, kw in groups.items()})


def override_text(changes: dict[str, Any]) -> tuple[str, ...]:
    """Hydra override strings of ``changes`` (booleans lower-case)."""
    return tuple(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def _candidate_changes(cfg: RunConfig, dims: ParallelDims) -> Iterator[dict[str, Any]]:
    """Single changes that save memory, cheapest first.

    Sequence parallelism, selective then full checkpointing, ZeRO-1, smaller micro-batches, more tensor parallelism
    within a node, more pipeline stages, more nodes (where the cluster can add nodes: ``can_add_nodes``).
    """
    par, c = cfg.parallelism, cfg.cluster
    if dims.tp > 1 and not par.sequence_parallel:
        yield {"parallelism.sequence_parallel": True}
    order = ("none", "selective", "full")
    for mode in order[order.index(par.activation_checkpointing) + 1 :]:
        yield {"parallelism.activation_checkpointing": mode}
    if dims.dp > 1 and not par.zero1:
        yield {"parallelism.zero1": True}
    mbs = cfg.train.micro_batch_size // 2
    while mbs >= 1:
        yield {"train.micro_batch_size": mbs}
        mbs //= 2
    for tp in valid_tp(cfg.model, dims.world_size):
        if dims.tp < tp <= max(c.devices_per_node, c.nproc_per_node):
            yield {"parallelism.tp": tp, "parallelism.sequence_parallel": True}
    for pp in range(dims.pp + 1, cfg.model.n_layers + 1):
        if cfg.model.n_layers % pp == 0:
            yield {"parallelism.pp": pp}
    for factor in NODE_FACTORS[1:] if can_add_nodes(c) else ():
        yield {"cluster.nodes": c.nodes * factor}


def _try(cfg: RunConfig, dims: ParallelDims, changes: dict[str, Any], budget: int) -> Fix | None:
    """The fix ``changes`` make, if the config stays valid, its backend runs it and the estimate fits ``budget``."""
    from hlat.layouts import check_layout

    try:
        new = with_changes(cfg, changes)
        world = dims.world_size * new.cluster.nodes // cfg.cluster.nodes
        new_dims = check_layout(new, ParallelDims.build(new.parallelism, world, new.model, new.train))
    except ConfigError:
        return None
    _, est = estimate_memory(new, new_dims)
    return Fix(override_text(changes), est, new_dims) if est.total <= budget else None


def suggest_fixes(cfg: RunConfig, dims: ParallelDims, budget_bytes: int, limit: int = 2) -> list[Fix]:
    """Up to ``limit`` changes, cheapest first, that the estimate predicts to fit ``budget_bytes`` per device.

    Only changes that the backend runs (``hlat.layouts.check_layout``, the trainer's own check) and that add nodes
    only where the cluster can (``can_add_nodes``).

    Single changes come first (in ``_candidate_changes`` order). When none fits alone, every memory saver is taken
    together (sequence parallelism, full checkpointing, ZeRO-1, micro-batch 1, the widest tensor parallelism within a
    node), then pipeline stages and nodes are added, fewest nodes first.
    """
    singles = list(_candidate_changes(cfg, dims))
    fixes = [f for ch in singles if (f := _try(cfg, dims, ch, budget_bytes))][:limit]
    if fixes:
        return fixes
    savers: dict[str, Any] = {"parallelism.zero1": True}
    for ch in singles:
        if not any(k.startswith(("parallelism.pp", "cluster.")) for k in ch):
            savers |= ch  # later candidates are stronger: full over selective, smaller micro-batches, wider tp
    savers = {k: v for k, v in savers.items() if getattr(_group(cfg, k), k.split(".")[1]) != v}
    pps = [d for d in range(cfg.parallelism.pp, cfg.model.n_layers + 1) if cfg.model.n_layers % d == 0]
    for factor in NODE_FACTORS if can_add_nodes(cfg.cluster) else NODE_FACTORS[:1]:
        for pp in pps:
            ch = savers | ({"parallelism.pp": pp} if pp != cfg.parallelism.pp else {})
            ch |= {"cluster.nodes": cfg.cluster.nodes * factor} if factor > 1 else {}
            if fix := _try(cfg, dims, ch, budget_bytes):
                fixes.append(fix)
                if len(fixes) == limit:
                    return fixes
                break  # the next suggestion, if any, with more nodes
    return fixes


def _group(cfg: RunConfig, key: str) -> Any:
    return getattr(cfg, key.split(".")[0])


NODE_FACTORS = (1, 2, 4, 8, 16, 32)
"""The node counts the advice tries, as multiples of ``cluster.nodes``."""


def cluster_fix(cfg: RunConfig) -> Fix | None:
    """The smallest cluster preset (fewest devices once fixed) on which ``cfg``, or a change of it, fits and runs.

    Only presets of known hardware (``cluster.device_memory_gib``): a preset of this machine plans against this
    host's memory. The overrides start with ``cluster=<preset>``; None when no preset fits.
    """
    best: Fix | None = None
    for cluster in cluster_presets():
        if cluster.device_memory_gib is None or cluster.name == cfg.cluster.name:
            continue
        new, budget, par = dataclasses.replace(cfg, cluster=cluster), planned_budget(cluster), cfg.parallelism
        world = cluster.world_size
        dims = ParallelDims(world, par.tp, par.pp, max(1, world // (par.tp * par.pp)))  # a start, maybe invalid
        fix = _try(new, dims, {}, budget) or next(iter(suggest_fixes(new, dims, budget, limit=1)), None)
        if fix is not None and (best is None or fix.dims.world_size < best.dims.world_size):
            best = Fix((f"cluster={cluster.name}", *fix.overrides), fix.memory, fix.dims)
    return best


def nothing_fits(cfg: RunConfig, fix: Fix | None) -> tuple[str, str]:
    """That no change ``cfg.cluster`` runs fits, and where to look instead (``fix``: ``cluster_fix``'s), as two clauses.

    ``check_fits`` joins them into its sentence; ``hlat plan`` prints each on a line of its own.
    """
    c = cfg.cluster
    one_host = not can_add_nodes(c)
    head = (
        f"No change that cluster={c.name} can run ({c.backend} backend{', one host' if one_host else ''}) is "
        f"predicted to fit: this needs {'a' if one_host else 'another'} cluster"
    )
    if fix is None:
        return head, "no preset in conf/cluster/ is predicted to fit it either"
    return head, (
        f"see `hlat plan model={cfg.model.name} {' '.join(fix.overrides)}` with your other overrides "
        f"(~{fix.memory.total / GiB:.1f} GiB per device)"
    )


def planned_budget(cluster: ClusterConfig) -> int:
    """Bytes one rank may use, for a dry run: ``cluster.device_memory_gib``, else this host's share of its memory."""
    if cluster.device_memory_gib is not None:
        free = int(cluster.device_memory_gib * GiB)
    elif cluster.device == "cuda" and (cuda_free := _cuda_free_bytes()) is not None:
        free = cuda_free
    else:
        import psutil

        free = psutil.virtual_memory().available // cluster.nproc_per_node
    return int(free * cluster.memory_fraction)


def _cuda_free_bytes() -> int | None:
    """Free memory of the current CUDA device, or None without one (torch is imported only for a cuda cluster)."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


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


def summary(
    cfg: RunConfig, dims: ParallelDims, n_params: int, est: Any, budget: int, bf16_matmul: str | None = None
) -> str:
    """A few lines describing the run before it starts (``bf16_matmul``: the backend's bf16 matmul policy)."""
    t = cfg.train
    tokens = t.global_batch_size * t.seq_len
    opt = "AdamW + master" if cfg.precision.master_weights else "AdamW"
    matmuls = f"bf16 matmuls {bf16_matmul} | " if bf16_matmul else ""
    return (
        f"model={cfg.model.name}: {n_params / 1e6:,.1f}M parameters | precision={cfg.precision.name} "
        f"({bytes_per_param(cfg.precision).total} bytes/parameter) | {matmuls}"
        f"world {dims.world_size} (tp {dims.tp}, pp {dims.pp}, dp {dims.dp})\n"
        f"batch: {t.global_batch_size} x {t.seq_len} = {tokens:,} tokens/step, micro-batch {t.micro_batch_size}, "
        f"grad accumulation {dims.grad_accum(t)} | {t.steps:,} steps = {tokens * t.steps / 1e9:,.3f}B tokens\n"
        f"memory per rank: ~{est.total / GiB:.2f} GiB (weights {est.params / GiB:.2f}, grads {est.grads / GiB:.2f}, "
        f"{opt} {est.optimizer / GiB:.2f}, activations {est.activations / GiB:.2f}) of {budget / GiB:.1f} GiB available"
    )


def check_run(
    cfg: RunConfig, dims: ParallelDims, budget_bytes: int, bf16_matmul: str | None = None
) -> tuple[int, MemoryEstimate]:
    """The trainer's plan on the layout of the world it got: logged with its memory, refused if it cannot fit.

    Runs before any allocation (``hlat.train.run``): an estimate over ``budget_bytes`` (the device's memory) raises
    ConfigError with the fix.

    Returns:
        The parameter count and the per-rank memory estimate.
    """
    n_params, est = estimate_memory(cfg, dims)
    log.info("%s", summary(cfg, dims, n_params, est, budget_bytes, bf16_matmul))
    check_fits(est, budget_bytes, cfg, dims=dims)
    return n_params, est


def summary_text(cfg: RunConfig) -> str:
    """The ``hlat summary`` (``train.dry_run=true``) text: parameters, batch and memory per rank.

    Planned for the cluster's world without touching a device: config arithmetic only (``hlat.sizing``,
    ``hlat.plan.memory``), no torch.
    """
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    n_params, est = estimate_memory(cfg, dims)
    return summary(cfg, dims, n_params, est, planned_budget(cfg.cluster))
