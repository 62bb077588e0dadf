"""The pre-flight report: per-rank figures, the verdict (which node fails and why), the table and the metrics.

The relative check compares nodes by their median rank: ranks of one host share it, so one slower than another is
no evidence of a bad node.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from hlat.config import ConfigError, HealthConfig
from hlat.health.neuron_tools import ToolResult

COLLECTIVE_KEYS = ("allreduce_busbw_gbps", "allgather_busbw_gbps", "latency_us")
JOB = "(job)"
"""The "node" of a failure that belongs to the whole job (the world's bandwidth)."""
PREFLIGHT_EXIT_CODE = 3
"""``python train.py``'s exit status when the pre-flight health check fails (2 is a configuration error)."""


class PreflightError(ConfigError):
    """The pre-flight check found a bad node; a ``ConfigError`` so that restarts stop at it, but exiting 3."""

    exit_code = PREFLIGHT_EXIT_CODE


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
    """The per-device peak it is compared with (None: none known)."""
    expected_source: str
    intra: dict[str, float] = field(default_factory=dict)
    """``COLLECTIVE_KEYS`` within this rank's node (empty: the node has one rank)."""
    world: dict[str, float] = field(default_factory=dict)
    """``COLLECTIVE_KEYS`` over the whole job (empty: one rank)."""
    expected_is_reference: bool = True
    """``expected_tflops`` is a reference the rank fails below (``cluster.peak_tflops``, a published figure); False:
    this host's own earlier measurement (``hlat bench peak``), shown in the table and noted, never failed."""


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
    notes: list[str] = field(default_factory=list)
    """What was seen but does not fail the check (:func:`observations`)."""

    @property
    def passed(self) -> bool:
        """No failure."""
        return not self.failures

    def failure_message(self) -> str:
        """One paragraph naming each failing node, its ranks and reasons, and what the user can do about it."""
        by_node: dict[str, list[str]] = {}
        for f in self.failures:
            by_node.setdefault(f.node, []).append(f"rank {f.rank}: {f.reason}" if f.rank is not None else f.reason)
        nodes = [n for n in by_node if n != JOB]
        parts = [f"node {n}: {'; '.join(by_node[n])}" for n in nodes]
        if JOB in by_node:
            parts.append(f"the job as a whole: {'; '.join(by_node[JOB])}")
        return (
            f"pre-flight check failed on {len(nodes)} of {self.nodes} node(s): "
            + " | ".join(parts)
            + f". {self._advice(nodes)}"
        )

    def _advice(self, nodes: list[str]) -> str:
        """The way out: exclude the named nodes where the job has others, otherwise what can be done on this one."""
        off = "or skip the check with health.preflight=off"
        if not nodes:
            return f"Check the network between the nodes (hlat doctor per pair of nodes), {off}"
        if self.nodes > 1:
            return f"Exclude node(s) {', '.join(nodes)} from the job (or repair them) and start again, {off}"
        broken = any(f.reason.startswith("device check failed") for f in self.failures)
        repair = "Repair the device or its driver (it computes wrong results), then start again; " if broken else ""
        peak = "set cluster.peak_tflops to this device's real peak or lower health.min_matmul_fraction"
        return (
            f"{repair}This job has one node, so there is no other node to move to: stop other work on this "
            "host's devices and cores (other jobs, benchmarks) and start again with the same command (with the "
            "same hydra.run.dir it continues from its newest checkpoint); if the expected peak is wrong, "
            f"{peak}; {off}"
        )

    def table(self) -> str:
        """A markdown table, one row per rank, then the peak it was held to, the notes and the node-level tools."""
        multi = self.nodes > 1
        median = _median([r.matmul_tflops for r in self.ranks])
        scope = "node" if multi else "node = world"
        head = [
            "node",
            "rank",
            "device",
            "matmul TFLOP/s",
            "of expected",
            "of median",
            f"all-reduce GB/s ({scope})",
            f"all-gather GB/s ({scope})",
            f"latency µs ({scope})",
        ]
        if multi:
            head += ["all-reduce GB/s (world)", "all-gather GB/s (world)", "latency µs (world)"]
        head.append("status")
        failing = {f.rank for f in self.failures if f.rank is not None}
        failing_nodes = {f.node for f in self.failures if f.rank is None}
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in self.ranks:
            device = f"{r.device} {'ok' if r.device_ok else 'BAD: ' + r.device_note}"
            cells = [
                r.node,
                str(r.rank),
                device,
                f"{r.matmul_tflops:.3g}",
                _pct(r.matmul_tflops, r.expected_tflops),
                _pct(r.matmul_tflops, median),
            ]
            cells += [_num(r.intra.get(k)) for k in COLLECTIVE_KEYS]
            if multi:
                cells += [_num(r.world.get(k)) for k in COLLECTIVE_KEYS]
            cells.append("FAIL" if r.rank in failing or r.node in failing_nodes else "ok")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("\n" + _peak_line(self.ranks, multi))
        lines += [f"note: {n}" for n in self.notes]
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
            "preflight/notes": float(len(self.notes)),
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
    """Every reason to fail: device errors, slow matmuls, slow collectives, tool failures.

    A rank's matmul is held to a reference peak only; nodes (each by its median rank) to the median node.
    """
    out = [Failure(r.node, r.rank, f"device check failed ({r.device_note})") for r in ranks if not r.device_ok]
    for r in ranks:
        bar = r.expected_tflops * cfg.min_matmul_fraction if r.expected_is_reference and r.expected_tflops else None
        if bar is not None and r.matmul_tflops < bar:
            out.append(
                Failure(
                    r.node,
                    r.rank,
                    f"matmul {r.matmul_tflops:.3g} TFLOP/s is "
                    f"{r.matmul_tflops / r.expected_tflops:.0%} of the expected {r.expected_tflops:.3g} "
                    f"({r.expected_source}; health.min_matmul_fraction="
                    f"{cfg.min_matmul_fraction:g})",
                )
            )
    per_node = node_medians(ranks)
    median = _median(list(per_node.values()))
    if len(per_node) > 1 and median:
        for node, value in per_node.items():
            if value < cfg.min_relative_fraction * median:
                out.append(
                    Failure(
                        node,
                        None,
                        f"matmul {value:.3g} TFLOP/s (the median of its ranks) is "
                        f"{value / median:.0%} of the nodes' median {median:.3g} "
                        f"(health.min_relative_fraction={cfg.min_relative_fraction:g})",
                    )
                )
    out += _bandwidth_failures(ranks, cfg)
    out += [Failure(t.node, None, f"{t.tool}: {t.summary}") for t in tools if not t.ok]
    return out


def node_medians(ranks: list[RankResult]) -> dict[str, float]:
    """Each node's median matmul TFLOP/s over its ranks, in order of first appearance."""
    by_node: dict[str, list[float]] = {}
    for r in ranks:
        by_node.setdefault(r.node, []).append(r.matmul_tflops)
    return {node: statistics.median(values) for node, values in by_node.items()}


def observations(ranks: list[RankResult], cfg: HealthConfig) -> list[str]:
    """What the check saw but does not fail: a rank slow within its node, or against its CPU's own peak."""
    out = []
    per_node = node_medians(ranks)
    for r in ranks:
        median = per_node[r.node]
        if median and r.matmul_tflops < cfg.min_relative_fraction * median:
            out.append(
                f"rank {r.rank} on {r.node} measured {r.matmul_tflops:.3g} TFLOP/s, "
                f"{r.matmul_tflops / median:.0%} of its node's median {median:.3g}; ranks that share a host "
                "are not held to each other (another process on this host's cores or device?)"
            )
        own_peak = r.expected_tflops if not r.expected_is_reference else None
        if own_peak and r.matmul_tflops < cfg.min_matmul_fraction * own_peak:
            out.append(
                f"rank {r.rank} on {r.node} measured {r.matmul_tflops / own_peak:.0%} of the "
                f"{r.expected_source} ({own_peak:.3g} TFLOP/s); not held to it: set cluster.peak_tflops to "
                "check against a figure"
            )
    return out


def _peak_line(ranks: list[RankResult], multi: bool) -> str:
    """The table's line on the expected peak and what the ranks were held to."""
    sources = "; ".join(sorted({r.expected_source for r in ranks}))
    if any(r.expected_is_reference and r.expected_tflops for r in ranks):
        return f"expected matmul peak per device: {sources}"
    against = "each node's median is held to the median node" if multi else "reported, not judged (one node)"
    return f"no reference matmul peak ({sources}): {against}; cluster.peak_tflops sets one"


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
            out.append(
                Failure(
                    node,
                    None,
                    f"intra-node all-reduce bus bandwidth {bw:.3g} GB/s is below "
                    f"{frac:g} x health.expected_busbw_gbps_intra={want:g}",
                )
            )
        if len(per_node) > 1 and median and bw < cfg.min_relative_fraction * median:
            out.append(
                Failure(
                    node,
                    None,
                    f"intra-node all-reduce bus bandwidth {bw:.3g} GB/s is {bw / median:.0%} "
                    f"of the nodes' median {median:.3g} (health.min_relative_fraction="
                    f"{cfg.min_relative_fraction:g})",
                )
            )
    world = [r.world["allreduce_busbw_gbps"] for r in ranks if r.world]
    want = cfg.expected_busbw_gbps_world
    if world and want and min(world) < frac * want:
        out.append(
            Failure(
                JOB,
                None,
                f"world all-reduce bus bandwidth {min(world):.3g} GB/s is below {frac:g} x "
                f"health.expected_busbw_gbps_world={want:g}",
            )
        )
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(value: float, of: float | None) -> str:
    return f"{value / of:.0%}" if of else "-"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
