"""Which sweep arms share their compiled graphs: signatures, groups, and why groups split (``hlat graphs plan``).

An arm is compared on four things:

- its **shape signature**: every ``shape`` key of ``hlat.plan.graph_keys`` at full scale, with the world size, the
  data-parallel degree and the kv-head copies (the traced twin is small, so it cannot stand in for these);
- its **env signature**: the graph-affecting part of the neuron backend's environment (``neuron_env``; the runtime's
  ``NEURON_RT_*``, ``FI_*`` and the cache's location are not in a graph), the compiler flags without the wrapper's
  own (``--cache_dir``...), and the pinned neuronx-cc version;
- its **twin fingerprints**: per phase (set-up, the first and the later micro-batches, the optimizer, the fetch, a
  checkpoint), the canonical fingerprints of the graphs its tiny twin ran, in order of first appearance;
- its **schedule**: the fetch lengths and the optimizer's special-scalar patterns of its whole run
  (``hlat.plan.graph_schedule``), the graphs that appear only after the twin's few steps.

Arms equal on all four run the same graphs (a *graph group*). Arms equal on the first three share every graph of
the twin and differ only in when late graphs appear: one ahead-of-time compile covers them when its run reaches the
union of their late graphs (a *compile group*). When unsure the planner splits: an arm whose twin could not be traced
is a group of its own. Pure: no torch-xla; the traces come from ``hlat.plan.graphs_command``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hlat.config import RunConfig
from hlat.parallel import ParallelDims
from hlat.plan.graph_keys import KEYS, SHAPE, TRACED, flat
from hlat.plan.graph_schedule import expected_compiles, fetch_lengths, optimizer_patterns

RUNTIME_ONLY = ("NEURON_RT_", "FI_", "MALLOC_ARENA_MAX", "NEURON_COMPILE_CACHE_URL", "PJRT_DEVICE", "NXD_CPU_MODE")
"""Variables (prefixes) of ``neuron_env`` that do not reach a graph or the compiler: runtime, libfabric, glibc, the
cache's location, the device choice of the NxD lane."""
WRAPPER_FLAGS = ("--cache_dir", "--retry_failed_compilation", "--log_level", "--log-level")
"""``NEURON_CC_FLAGS`` entries that the Neuron wrapper parses itself and does not pass to neuronx-cc (the Neuron
persistent-cache docs); whether they enter the cache key's flags hash is open question Q1 of docs/trn1.md."""


def shape_signature(cfg: RunConfig) -> dict[str, Any]:
    """The values of every ``shape`` key, with the world size, data-parallel degree and kv-head copies."""
    values = flat(cfg)
    sig = {k: values[k] for k, (cls, _) in KEYS.items() if cls == SHAPE}
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    sig |= {"world_size": dims.world_size, "dp": dims.dp, "kv_replicas": dims.kv_replicas(cfg.model)}
    return sig


def compiler_flags(flags: str) -> str:
    """``NEURON_CC_FLAGS`` as neuronx-cc sees them: the wrapper's own flags dropped, the order kept."""
    return " ".join(f for f in flags.split() if not f.startswith(WRAPPER_FLAGS))


def env_signature(env: dict[str, str], compiler_version: str | None) -> dict[str, str]:
    """The graph-affecting part of a neuron run's environment (see the module docstring)."""
    sig = {k: v for k, v in sorted(env.items()) if not k.startswith(RUNTIME_ONLY)}
    if "NEURON_CC_FLAGS" in sig:
        sig["NEURON_CC_FLAGS"] = compiler_flags(sig["NEURON_CC_FLAGS"])
    sig["neuronx-cc"] = compiler_version or "unpinned (not installed here)"
    return sig


class GraphEvent(Protocol):
    """What the planner reads of a ledger event (``hlat.backends.graphs.GraphEvent``; the backends sit above it)."""

    phase: str
    micro: int | None
    graphs: tuple[str, ...]


def phase_key(e: GraphEvent) -> str:
    """The phase a graph belongs to, micro-batches folded into the first and the later ones (their count is data)."""
    if e.micro is None:
        return e.phase
    return f"{e.phase}/{'first' if e.micro == 0 else 'later'}"


def twin_fingerprints(ledgers: Sequence[Sequence[GraphEvent]]) -> list[dict[str, list[str]]]:
    """Per rank of the twin: phase -> the distinct fingerprints its graphs had there, in order of first appearance."""
    out = []
    for events in ledgers:
        phases: dict[str, list[str]] = {}
        for e in events:
            seen = phases.setdefault(phase_key(e), [])
            seen += [g for g in e.graphs if g not in seen]
        out.append(phases)
    return out


def schedule_signature(cfg: RunConfig) -> dict[str, Any]:
    """What the schedule adds to the twin's graphs over the whole run: fetch lengths, optimizer patterns, saves."""
    patterns = optimizer_patterns(cfg, range(1, cfg.train.steps + 1))
    return {
        "fetch_lengths": sorted({n for _, n in fetch_lengths(cfg)}),
        "optimizer_patterns": sorted({tuple(int(x) for x in p) for p in patterns}),
        "late": [e.text() for e in expected_compiles(cfg)],
    }


@dataclass
class Arm:
    """One sweep arm: its overrides, config, signatures and what became of its trace."""

    name: str
    overrides: list[str]
    cfg: RunConfig | None = None
    refused: str | None = None
    """Why the arm is not a valid run here (the configuration error), or None."""
    shape: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    twin: list[dict[str, list[str]]] = field(default_factory=list)
    schedule: dict[str, Any] = field(default_factory=dict)
    traced: str | None = None
    """Why the twin could not be traced (split: unsure), or None once it was."""
    keep: tuple[str, ...] = ()
    """Keys the twin keeps at the arm's value even where it shrinks them (``--verify`` of ``train.seq_len``...)."""

    def key(self, *, with_schedule: bool) -> str:
        """A digest of the signatures: equal keys, equal graphs (an untraced arm's key is unique)."""
        if self.refused or self.traced:
            return f"alone:{self.name}"
        parts: dict[str, Any] = {"shape": self.shape, "env": self.env, "twin": self.twin}
        if with_schedule:
            parts["schedule"] = {k: v for k, v in self.schedule.items() if k != "late"}
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def group(arms: Sequence[Arm], *, with_schedule: bool) -> list[list[Arm]]:
    """Arms with equal keys, in the order their first member appears (refused arms are left out)."""
    groups: dict[str, list[Arm]] = {}
    for arm in arms:
        if not arm.refused:
            groups.setdefault(arm.key(with_schedule=with_schedule), []).append(arm)
    return list(groups.values())


def why_split(a: Arm, b: Arm) -> list[str]:
    """What differs between two arms' signatures, and the config keys behind it with their mechanism."""
    if a.traced or b.traced:
        return [f"not traced ({a.traced or b.traced}): split, since unsure"]
    out = []
    keys = [k for k in KEYS if k in flat(a.cfg) and flat(a.cfg)[k] != flat(b.cfg)[k]] if a.cfg and b.cfg else []
    shape = [k for k in a.shape if a.shape[k] != b.shape.get(k)]
    if shape:
        out.append("shape: " + ", ".join(f"{k} {a.shape[k]} vs {b.shape.get(k)}" for k in shape))
    env = sorted(k for k in set(a.env) | set(b.env) if a.env.get(k) != b.env.get(k))
    for k in env:
        what = "compiler flags" if k == "NEURON_CC_FLAGS" else "environment"
        out.append(f"{what}: {k}={a.env.get(k, '(unset)')} vs {b.env.get(k, '(unset)')}")
    phases = sorted(
        {p for ra, rb in zip(a.twin, b.twin, strict=False) for p in set(ra) | set(rb) if ra.get(p) != rb.get(p)}
    )
    if phases or len(a.twin) != len(b.twin):
        out.append("graphs of the twin differ in " + (", ".join(phases) or "their ranks"))
    sa, sb = a.schedule, b.schedule
    for k in ("fetch_lengths", "optimizer_patterns"):
        if sa.get(k) != sb.get(k):
            out.append(f"schedule: {k.replace('_', ' ')} {sa.get(k)} vs {sb.get(k)}")
    for k in keys:
        cls, mechanism = KEYS[k]
        va, vb = flat(a.cfg)[k], flat(b.cfg)[k]  # type: ignore[arg-type]
        special = " (exactly 0 or 1: a constant in the graph)" if cls == TRACED and any(map(_special, (va, vb))) else ""
        out.append(f"key {k}: {va} vs {vb} [{cls}: {mechanism}]{special}")
    return out


def _special(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) in (0, 1)
