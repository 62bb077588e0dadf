"""The pre-flight report: per-rank figures, the verdict (which node fails and why), the table and the metrics."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from hlat.config import ConfigError, HealthConfig
from hlat.health.neuron_tools import ToolResult

COLLECTIVE_KEYS = ("allreduce_busbw_gbps", "allgather_busbw_gbps", "latency_us")
JOB = "(job)"
"""The "node" of a failure that belongs to the whole job (the world's bandwidth)."""


class PreflightError(ConfigError):
    """The pre-flight check found a bad node. A restart on the same nodes would fail again: not retried."""


@dataclass
class RankResult:
    """What one rank measured."""

    rank: int
    node: str
    """Host name."""
    local_rank: int
    device: str
    device_ok: bool
    """The device computed a known matmul (and the job an all-reduce) correctly."""
    device_note: str
    matmul_tflops: float
    """Best-window matmul TFLOP/s at the run's compute dtype."""
    expected_tflops: float | None
    """The per-device peak it is held to (None: none known, relative check only)."""
    expected_source: str
    intra: dict[str, float] = field(default_factory=dict)
    """``COLLECTIVE_KEYS`` within this rank's node (empty: the node has one rank)."""
    world: dict[str, float] = field(default_factory=dict)
    """``COLLECTIVE_KEYS`` over the whole job (empty: one rank)."""


@dataclass
class Failure:
    """One reason a node (or the job) fails."""

    node: str
    rank: int | None
    reason: str


@dataclass
class HealthReport:
    """Everything the check found, and its verdict."""

    ranks: list[RankResult]
    tools: list[ToolResult]
    failures: list[Failure]
    nodes: int

    @property
    def passed(self) -> bool:
        """No failure."""
        return not self.failures

    def failure_message(self) -> str:
        """One paragraph naming each failing node, its ranks and reasons, and the way out."""
        by_node: dict[str, list[str]] = {}
        for f in self.failures:
            by_node.setdefault(f.node, []).append(f"rank {f.rank}: {f.reason}" if f.rank is not None else f.reason)
        nodes = [n for n in by_node if n != JOB]
        parts = [f"node {n}: {'; '.join(by_node[n])}" for n in nodes]
        if JOB in by_node:
            parts.append(f"the job as a whole: {'; '.join(by_node[JOB])}")
        fix = (f"exclude node(s) {', '.join(nodes)} from the job (or repair them) and start again"
               if nodes else "check the network between the nodes (hlat doctor per pair of nodes)")  # fmt: skip
        return (f"pre-flight check failed on {len(nodes)} of {self.nodes} node(s): " + " | ".join(parts)
                + f". {fix}, or skip the check with health.preflight=off")  # fmt: skip

    def table(self) -> str:
        """A markdown table, one row per rank, then one line per node-level tool."""
        multi = self.nodes > 1
        median = _median([r.matmul_tflops for r in self.ranks])
        scope = "node" if multi else "node = world"
        head = ["node", "rank", "device", "matmul TFLOP/s", "of expected", "of median",
                f"all-reduce GB/s ({scope})", f"all-gather GB/s ({scope})", f"latency µs ({scope})"]  # fmt: skip
        if multi:
            head += ["all-reduce GB/s (world)", "all-gather GB/s (world)", "latency µs (world)"]
        head.append("status")
        failing = {f.rank for f in self.failures if f.rank is not None}
        failing_nodes = {f.node for f in self.failures if f.rank is None}
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in self.ranks:
            device = f"{r.device} {'ok' if r.device_ok else 'BAD: ' + r.device_note}"
            cells = [r.node, str(r.rank), device, f"{r.matmul_tflops:.3g}", _pct(r.matmul_tflops, r.expected_tflops),
                     _pct(r.matmul_tflops, median)]  # fmt: skip
            cells += [_num(r.intra.get(k)) for k in COLLECTIVE_KEYS]
            if multi:
                cells += [_num(r.world.get(k)) for k in COLLECTIVE_KEYS]
            cells.append("FAIL" if r.rank in failing or r.node in failing_nodes else "ok")
            lines.append("| " + " | ".join(cells) + " |")
        sources = "; ".join(sorted({r.expected_source for r in self.ranks}))
        if any(r.expected_tflops for r in self.ranks):
            lines.append(f"\nexpected matmul peak per device: {sources}")
        else:
            lines.append(f"\nno expected matmul peak ({sources}): the ranks are held to their median only")
        for t in self.tools:
            lines.append(f"{t.tool} on {t.node}: {'ok' if t.ok else 'FAIL'}: {t.summary}")
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """``preflight/*`` figures for MLflow: the verdict, the slowest rank, the job's collective figures."""
        mm = [r.matmul_tflops for r in self.ranks]
        out = {
            "preflight/passed": float(self.passed),
            "preflight/failures": float(len(self.failures)),
            "preflight/ranks": float(len(self.ranks)),
            "preflight/nodes": float(self.nodes),
            "preflight/matmul_tflops_min": min(mm),
            "preflight/matmul_tflops_median": _median(mm) or 0.0,
            "preflight/slowest_rank": float(min(self.ranks, key=lambda r: r.matmul_tflops).rank),
        }
        fractions = [r.matmul_tflops / r.expected_tflops for r in self.ranks if r.expected_tflops]
        if fractions:
            out["preflight/matmul_fraction_of_expected_min"] = min(fractions)
        for scope in ("world", "intra"):
            rows = [getattr(r, scope) for r in self.ranks if getattr(r, scope)]
            if rows:  # bandwidth: the slowest rank's view; latency: the longest
                out[f"preflight/{scope}_allreduce_busbw_gbps"] = min(x["allreduce_busbw_gbps"] for x in rows)
                out[f"preflight/{scope}_allgather_busbw_gbps"] = min(x["allgather_busbw_gbps"] for x in rows)
                out[f"preflight/{scope}_latency_us"] = max(x["latency_us"] for x in rows)
        for t in self.tools:
            for k, v in t.figures.items():
                out[f"preflight/{t.node}/{t.tool.replace(' ', '_')}/{k}"] = float(v)
        return out


def evaluate(ranks: list[RankResult], tools: list[ToolResult], cfg: HealthConfig) -> list[Failure]:
    """Every reason to fail: device errors, slow matmuls (absolute and relative), slow collectives, tool failures."""
    out = [Failure(r.node, r.rank, f"device check failed ({r.device_note})") for r in ranks if not r.device_ok]
    median = _median([r.matmul_tflops for r in ranks])
    for r in ranks:
        if r.expected_tflops and r.matmul_tflops < cfg.min_matmul_fraction * r.expected_tflops:
            out.append(Failure(r.node, r.rank, f"matmul {r.matmul_tflops:.3g} TFLOP/s is "
                               f"{r.matmul_tflops / r.expected_tflops:.0%} of the expected {r.expected_tflops:.3g} "
                               f"({r.expected_source}; health.min_matmul_fraction="
                               f"{cfg.min_matmul_fraction:g})"))  # fmt: skip
        if len(ranks) > 1 and median and r.matmul_tflops < cfg.min_relative_fraction * median:
            out.append(Failure(r.node, r.rank, f"matmul {r.matmul_tflops:.3g} TFLOP/s is "
                               f"{r.matmul_tflops / median:.0%} of the ranks' median {median:.3g} "
                               f"(health.min_relative_fraction={cfg.min_relative_fraction:g})"))  # fmt: skip
    out += _bandwidth_failures(ranks, cfg)
    out += [Failure(t.node, None, f"{t.tool}: {t.summary}") for t in tools if not t.ok]
    return out


def _bandwidth_failures(ranks: list[RankResult], cfg: HealthConfig) -> list[Failure]:
    """Intra-node all-reduce bandwidth per node (absolute and against the other nodes), and the world's."""
    per_node: dict[str, float] = {}
    for r in ranks:
        if r.intra:
            per_node[r.node] = min(per_node.get(r.node, float("inf")), r.intra["allreduce_busbw_gbps"])
    out = []
    median = _median(list(per_node.values()))
    want, frac = cfg.expected_busbw_gbps_intra, cfg.min_bandwidth_fraction
    for node, bw in per_node.items():
        if want and bw < frac * want:
            out.append(Failure(node, None, f"intra-node all-reduce bus bandwidth {bw:.3g} GB/s is below "
                               f"{frac:g} x health.expected_busbw_gbps_intra={want:g}"))  # fmt: skip
        if len(per_node) > 1 and median and bw < cfg.min_relative_fraction * median:
            out.append(Failure(node, None, f"intra-node all-reduce bus bandwidth {bw:.3g} GB/s is {bw / median:.0%} "
                               f"of the nodes' median {median:.3g} (health.min_relative_fraction="
                               f"{cfg.min_relative_fraction:g})"))  # fmt: skip
    world = [r.world["allreduce_busbw_gbps"] for r in ranks if r.world]
    want = cfg.expected_busbw_gbps_world
    if world and want and min(world) < frac * want:
        out.append(Failure(JOB, None, f"world all-reduce bus bandwidth {min(world):.3g} GB/s is below {frac:g} x "
                           f"health.expected_busbw_gbps_world={want:g}"))  # fmt: skip
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(value: float, of: float | None) -> str:
    return f"{value / of:.0%}" if of else "-"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
