"""Schema of cluster health (``conf/health/``): pre-flight check, hang watchdog, stragglers, graph divergence."""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config.base import _check_choice, _check_range, _Frozen

PREFLIGHT_MODES = ("auto", "on", "off")
GRAPH_GUARD_MODES = ("stop", "warn", "off")


@dataclass
class HealthConfig(_Frozen):
    """Cluster health (``conf/health/``, docs/health.md): catch a bad node before the job, a hung job in minutes."""

    name: str = "default"
    """Preset name."""
    preflight: str = "auto"
    """Pre-flight burn-in of ``python train.py``: auto (on for multi-process runs), on or off (quote it in YAML:
    ``'off'``)."""
    matmul_size: int | None = None
    """Side n of the square matmuls timed per rank; null: 1024 on CPU, 8192 on an accelerator (which small ones do
    not fill)."""
    matmul_seconds: float = 0.25
    """Length in seconds of each timed matmul window (``hlat.plan.peak.measure_matmul_flops``)."""
    matmul_repeats: int = 3
    """Timed matmul windows per rank; the best one counts (the peak a device can reach)."""
    min_matmul_fraction: float = 0.5
    """A rank fails below this fraction of a reference per-device peak (``cluster.peak_tflops`` or a published
    figure; a CPU's own measured peak never fails a rank)."""
    min_relative_fraction: float = 0.6
    """A node fails when its median matmul FLOP/s or its intra-node bus bandwidth is below this fraction of the
    median node's (0: off)."""
    collective_mib: float = 32.0
    """MiB of the all-reduce and all-gather whose bus bandwidth is measured (nccom-test's default size)."""
    collective_iters: int = 5
    """Timed repetitions of each collective (after 2 untimed ones); latency uses 4x as many 1-element all-reduces."""
    expected_busbw_gbps_intra: float | None = None
    """Expected all-reduce bus bandwidth within a node in GB/s (e.g. from ``hlat doctor`` on a known-good node);
    null: no absolute check within nodes."""
    expected_busbw_gbps_world: float | None = None
    """Expected all-reduce bus bandwidth over the whole job in GB/s; null: no absolute check over the world."""
    min_bandwidth_fraction: float = 0.5
    """A node (intra-node figure) or the job (world figure) fails below this fraction of the expected bandwidth."""
    watchdog: bool = True
    """Hang watchdog: a step far slower than usual dumps stacks into ``<run dir>/hang/`` and exits 75, which torch
    elastic restarts from the newest checkpoint."""
    watchdog_factor: float = 10.0
    """A step hangs when it runs longer than this many times the median of the recent steps (or the floor)."""
    watchdog_floor_s: float = 600.0
    """Seconds a step may always take: more than the slowest legitimate step, its hooks (a synchronous save, a
    rollback) included."""
    watchdog_first_step_s: float = 3600.0
    """Seconds the first two steps of a (re)started trainer may take (compilation, the restore)."""
    watchdog_grace_s: float = 10.0
    """After dumping its stacks a rank waits max(this, 2 x the median step) before it exits, so the other ranks
    dump theirs too."""
    collective_timeout_s: float = 900.0
    """Timeout of torch.distributed collectives in seconds: more than one rank's longest wait for another (a
    checkpoint write, the first compilation)."""
    straggler_every: int = 100
    """Every this many steps, log the slowest rank's step and local time and its lag (``health/*``); 0: off."""
    straggler_warn_ratio: float = 1.25
    """Log a warning naming the slowest rank when its local time exceeds this multiple of the median rank's."""
    graph_guard: str = "stop"
    """Ranks of one class compiling different graphs at a step (on trn1 a hang): ``stop`` exits 76 naming rank, step
    and phase, ``warn`` logs it, ``off`` (quoted in YAML); the graph ledger stays on (docs/trn1.md)."""
    graph_hlo_dir: str | None = None
    """Each rank writes every graph it runs here as HLO, fingerprinted in the graph ledger (``hlat graphs plan``'s
    traces); null: compile counts and times only. Lowers every sync to HLO: not for long runs."""
    inject_slow_rank: int | None = None
    """TEST HOOK: this rank's pre-flight matmuls run at ``inject_slow_factor`` of their speed; null in real runs."""
    inject_slow_factor: float = 0.1
    """TEST HOOK: the speed, as a fraction, of the matmuls of ``inject_slow_rank``."""

    def __post_init__(self) -> None:
        _check_choice("health.preflight", self.preflight, PREFLIGHT_MODES)
        _check_range(self, "health.matmul_size", ">= 16", null="by device", example=1024)
        _check_range(self, "health.matmul_seconds", "> 0", note="(seconds)")
        _check_range(self, "health.matmul_repeats", ">= 1")
        for key in ("min_matmul_fraction", "min_relative_fraction", "min_bandwidth_fraction"):
            _check_range(self, f"health.{key}", "[0, 1]", note="(0 turns the check off)")
        _check_range(self, "health.collective_mib", "> 0")
        _check_range(self, "health.collective_iters", ">= 1")
        for key in ("expected_busbw_gbps_intra", "expected_busbw_gbps_world"):
            _check_range(self, f"health.{key}", "> 0", null="no absolute check")
        _check_range(self, "health.watchdog_factor", "> 1", note="(times the median step)")
        for key in ("watchdog_floor_s", "watchdog_first_step_s", "collective_timeout_s"):
            _check_range(self, f"health.{key}", "> 0", note="(seconds)")
        _check_range(self, "health.watchdog_grace_s", ">= 0", note="(seconds)")
        _check_range(self, "health.straggler_every", ">= 0", note="(0: off)")
        _check_range(self, "health.straggler_warn_ratio", ">= 1")
        _check_choice("health.graph_guard", self.graph_guard, GRAPH_GUARD_MODES)
        _check_range(self, "health.inject_slow_rank", ">= 0", null="no slow rank", note="(a rank of the job)")
        _check_range(self, "health.inject_slow_factor", "(0, 1]")
        self._freeze()

    def preflight_enabled(self, world_size: int) -> bool:
        """Whether ``python train.py`` runs the pre-flight check: ``auto`` means for more than one process."""
        return self.preflight == "on" or (self.preflight == "auto" and world_size > 1)
