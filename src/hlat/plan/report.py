"""``hlat plan``: memory per device, step time, MFU and cost of a config on a cluster, before any hardware is used.

The plan of one config, or a scaling table over node counts; docs/planner.md describes the models and their errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from hlat.config import ConfigError, RunConfig
from hlat.parallel import ParallelDims
from hlat.plan.memory import (
    Fix,
    GiB,
    MemoryEstimate,
    cluster_fix,
    estimate_memory,
    nothing_fits,
    planned_budget,
    suggest_fixes,
)
from hlat.plan.memory import with_changes as _with_changes
from hlat.plan.step_model import Hardware, StepEstimate, estimate_step


@dataclass(frozen=True)
class Plan:
    """Everything ``hlat plan`` predicts for one config."""

    cfg: RunConfig
    """The config planned (with the adapted layout, if ``adapted``)."""
    dims: ParallelDims
    n_params: int
    memory: MemoryEstimate
    budget: int
    """Bytes one device may use (``hlat.plan.memory.planned_budget``)."""
    step: StepEstimate | None
    """None when the cluster preset has no step-time model (``no_step`` says why)."""
    no_step: str = ""
    adapted: str = ""
    """Non-empty when the configured layout does not fit the world and a smaller pp/tp was planned instead."""
    fixes: list[Fix] = field(default_factory=list)
    """When it does not fit: the changes the memory estimate predicts to fit (and the backend runs)."""
    cluster_fix: Fix | None = None
    """When it does not fit and no change does: the smallest cluster preset that would (``memory.cluster_fix``)."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget


def adapt_layout(cfg: RunConfig, world: int) -> tuple[RunConfig, str]:
    """The nearest layout that fits ``world`` ranks (the configured tp if it can), and a note of what changed.

    Raises:
        ConfigError: when no layout fits.
    """
    par, layers = cfg.parallelism, cfg.model.n_layers
    for tp in sorted((t for t in range(1, par.tp + 1) if par.tp % t == 0), reverse=True):
        for pp in sorted((p for p in range(1, par.pp + 1) if layers % p == 0), reverse=True):
            changes = {"parallelism.tp": tp, "parallelism.pp": pp}
            if tp == 1:
                changes["parallelism.sequence_parallel"] = False
            try:
                new = _with_changes(cfg, changes)
                ParallelDims.build(new.parallelism, world, new.model, new.train)
            except ConfigError:
                continue
            return new, (
                f"tp {par.tp} x pp {par.pp} needs {par.tp * par.pp} ranks per replica and this world has "
                f"{world}: planned with tp {tp} x pp {pp} instead"
            )
    raise ConfigError(
        f"no tp x pp layout up to tp {par.tp} x pp {par.pp} fits a world of {world} ranks: set parallelism.tp and "
        f"parallelism.pp so that tp x pp divides {world}, or change cluster.nodes / cluster.nproc_per_node"
    )


def make_plan(cfg: RunConfig, *, adapt: bool = False, hint: bool = True) -> Plan:
    """Plan ``cfg`` for the world of its cluster preset.

    ``adapt``: plan the nearest layout that fits instead of raising; ``hint``: name the smallest cluster preset that
    would fit when nothing does.

    Raises:
        ConfigError: The layout does not fit the world (and ``adapt`` is false).
    """
    world, note = cfg.cluster.world_size, ""
    try:
        dims = ParallelDims.build(cfg.parallelism, world, cfg.model, cfg.train)
    except ConfigError:
        if not adapt:
            raise
        cfg, note = adapt_layout(cfg, world)
        dims = ParallelDims.build(cfg.parallelism, world, cfg.model, cfg.train)
    n, mem = estimate_memory(cfg, dims)
    budget = planned_budget(cfg.cluster)
    step, why = None, ""
    try:
        step = estimate_step(cfg, dims, Hardware.of(cfg.cluster), n)
    except ConfigError as e:
        why = str(e)
    fixes = suggest_fixes(cfg, dims, budget) if mem.total > budget else []
    other = cluster_fix(cfg) if hint and mem.total > budget and not fixes else None
    return Plan(cfg, dims, n, mem, budget, step, why, note, fixes, other)


def _activation_grid(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    """Activation GiB per device for each checkpointing mode, with and without sequence parallelism."""
    lines = ["  activations by checkpointing mode (GiB):        none  selective       full"]
    now = (cfg.parallelism.activation_checkpointing, cfg.parallelism.sequence_parallel)
    for sp in [True, False] if dims.tp > 1 else [False]:
        cells = []
        for mode in ("none", "selective", "full"):
            c = _with_changes(cfg, {"parallelism.activation_checkpointing": mode, "parallelism.sequence_parallel": sp})
            _, est = estimate_memory(c, dims)
            cells.append(f"{est.activations / GiB:9.2f}{'*' if (mode, sp) == now else ' '}")
        label = f"sequence parallel {'on' if sp else 'off'}" if dims.tp > 1 else "(tp 1: no sequence parallelism)"
        lines.append(f"    {label:<42}{''.join(cells)}")
    return lines


def _memory_lines(p: Plan) -> list[str]:
    m, c = p.memory, p.cfg.cluster
    where = f"{c.device_memory_gib:g} GiB" if c.device_memory_gib is not None else "this host's free memory"
    verdict = (
        f"fits ({(p.budget - m.total) / GiB:.2f} GiB spare)"
        if p.fits
        else f"DOES NOT FIT ({(m.total - p.budget) / GiB:.2f} GiB over)"
    )
    lines = [
        f"memory per device (GiB; budget {p.budget / GiB:.2f} = {where} x cluster.memory_fraction "
        f"{c.memory_fraction:g}):",
        f"  parameters        {m.params / GiB:9.2f}",
        f"  gradients         {m.grads / GiB:9.2f}",
        f"  optimizer states  {(m.optimizer - m.master) / GiB:9.2f}   (AdamW moments)",
        f"  master weights    {m.master / GiB:9.2f}",
        f"  activations       {m.activations / GiB:9.2f}   (incl. fp32 logits and their gradient)",
        f"  total             {m.total / GiB:9.2f}   {verdict}",
    ]
    lines += _activation_grid(p.cfg, p.dims)
    for f in p.fixes:
        lines.append(f"  would fit: {' '.join(f.overrides)}  (~{f.memory.total / GiB:.2f} GiB)")
    if not p.fits and not p.fixes:
        lines += [f"  {clause}" for clause in nothing_fits(p.cfg, p.cluster_fix)]
    return lines


def _step_lines(p: Plan) -> list[str]:
    s, t = p.step, p.cfg.train
    if s is None:
        return [f"step time: not modelled ({p.no_step})"]
    lines = [f"step time (hlat.plan.step_model; docs/planner.md): {s.step_s:.3f} s"]
    for name, sec in s.components().items():
        if sec > 0:
            lines.append(f"  {name:<17}{sec:9.3f} s  {100 * sec / s.step_s:5.1f}%")
    lines.append(
        f"throughput: {s.tokens_per_s:,.0f} tokens/s | MFU {100 * s.mfu:.1f}% (as perf/mfu) | "
        + (
            f"CPT ${s.cost_per_4m_tokens:,.2f} per 4M tokens"
            if s.cost_per_4m_tokens is not None
            else "no cost (cluster.price_per_hour is null)"
        )
    )
    tokens = t.steps * s.tokens_per_step
    hours = t.steps * s.step_s / 3600
    cost = f", ${hours * s.nodes * s.price_per_hour:,.0f}" if s.price_per_hour is not None else ""
    lines.append(
        f"run: {t.steps:,} steps = {tokens / 1e9:,.1f}B tokens: {hours:,.1f} h ({hours / 24:,.1f} days) "
        f"on {s.nodes} node(s){cost}"
    )
    return lines


def format_plan(p: Plan) -> str:
    """The human-readable report of ``hlat plan``."""
    c, d, par = p.cfg.cluster, p.dims, p.cfg.parallelism
    savers = [s for s, on in (("sequence parallel", par.sequence_parallel), ("ZeRO-1", par.zero1)) if on]
    mbs, accum = p.cfg.train.micro_batch_size, d.grad_accum(p.cfg.train)
    head = [
        f"model={p.cfg.model.name}: {p.n_params / 1e9:,.2f}B parameters | precision={p.cfg.precision.name} | "
        f"cluster={c.name}: {c.nodes} x {c.instance_type or c.device}, {d.world_size} ranks",
        f"layout: tp {d.tp} x pp {d.pp} x dp {d.dp}; {par.activation_checkpointing} checkpointing"
        + "".join(f", {s}" for s in savers)
        + f"; micro-batch {mbs} x {accum} per rank and step",
    ]
    if p.adapted:
        head.append(f"NOTE: {p.adapted}")
    return "\n".join([*head, "", *_memory_lines(p), "", *_step_lines(p)])


def plan_dict(p: Plan) -> dict:
    """``--json``: the plan as plain data (bytes, seconds, fractions)."""
    out: dict = {
        "model": p.cfg.model.name,
        "cluster": p.cfg.cluster.name,
        "nodes": p.cfg.cluster.nodes,
        "layout": {"tp": p.dims.tp, "pp": p.dims.pp, "dp": p.dims.dp},
        "adapted": p.adapted,
        "n_params": p.n_params,
        "memory": asdict(p.memory) | {"total": p.memory.total},
        "budget": p.budget,
        "fits": p.fits,
        "fixes": [{"overrides": list(f.overrides), "total": f.memory.total} for f in p.fixes],
        "cluster_fix": {"overrides": list(p.cluster_fix.overrides), "total": p.cluster_fix.memory.total}
        if p.cluster_fix
        else None,
    }
    if p.step is not None:
        s = p.step
        out["step"] = {
            "step_s": s.step_s,
            "components_s": s.components(),
            "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu,
            "cost_per_4m_tokens": s.cost_per_4m_tokens,
        }
    return out


def scaling_rows(cfg: RunConfig, nodes: Sequence[int]) -> list[dict]:
    """Plan ``cfg`` on each node count; scaling efficiency is MFU relative to the smallest count's."""
    rows = []
    for n in sorted(nodes):
        p = make_plan(_with_changes(cfg, {"cluster.nodes": n}), adapt=True, hint=False)
        rows.append(plan_dict(p))
    base = next((r["step"]["mfu"] for r in rows if "step" in r), None)
    for r in rows:
        if "step" in r and base:
            r["step"]["scaling_efficiency"] = r["step"]["mfu"] / base
    return rows


def format_scaling(rows: list[dict]) -> str:
    """The ``--nodes`` table."""
    out = [
        "nodes  tp x pp x dp   GiB/device  fits   step s    tokens/s    MFU  scaling    CPT $",
        "-----  ------------   ----------  ----   ------    --------    ---  -------    -----",
    ]
    for r in rows:
        lay = r["layout"]
        cells = [
            f"{r['nodes']:5d}",
            f"{lay['tp']:>4} x {lay['pp']:>2} x {lay['dp']:<4}",
            f"{r['memory']['total'] / GiB:10.2f}",
            f"{'yes' if r['fits'] else 'NO':>4}",
        ]
        if "step" in r:
            s = r["step"]
            cpt = f"{s['cost_per_4m_tokens']:8.2f}" if s["cost_per_4m_tokens"] is not None else "       -"
            cells += [
                f"{s['step_s']:8.2f}",
                f"{s['tokens_per_s']:11,.0f}",
                f"{100 * s['mfu']:5.1f}%",
                f"{100 * s['scaling_efficiency']:7.1f}%",
                cpt,
            ]
        out.append("  ".join(cells) + ("   (layout adapted)" if r["adapted"] else ""))
    return "\n".join(out)
