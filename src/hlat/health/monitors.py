"""The trainer's in-run health machinery, built in one place.

The hang watchdog and its heartbeat, the stragglers, the graph ledger and its divergence guard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from hlat.backends.base import Env
from hlat.backends.graphs import GraphLedger
from hlat.config import RunConfig
from hlat.health.graph_watch import GraphWatch
from hlat.health.heartbeat import Heartbeat, PhaseMarks, beat_period, board_for
from hlat.health.stragglers import Rows, StragglerMonitor
from hlat.health.watchdog import HangWatchdog
from hlat.launch import attempt


class Monitors:
    """Loop hooks of ``health``: the watchdog and heartbeat, the stragglers, the graph ledger's hook and guard.

    ``watchdog``, ``straggler_every`` and ``graph_guard`` turn them on (the ledger's hook: a backend with a ledger).

    Build it on every rank at the same point (the straggler monitor creates a process group), ``start`` it right
    before the first step and ``close`` it however training ends. Files go under ``<run_dir>/hang``,
    ``<run_dir>/heartbeat`` and ``<run_dir>/graphs``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        env: Env,
        model: nn.Module,
        run_dir: Path,
        log_metrics: Callable[[Rows], None],
        ledger: GraphLedger | None = None,
    ) -> None:
        h = cfg.health
        self.watchdog: HangWatchdog | None = None
        self.heartbeat: Heartbeat | None = None
        guarded = ledger is not None and h.graph_guard != "off" and env.world_size > 1
        if h.watchdog or guarded:
            board = board_for(env.world_size, run_dir / "heartbeat")
            self.heartbeat = Heartbeat(env.rank, board, attempt=attempt.current(), every_s=beat_period(env.world_size))
        if h.watchdog:
            self.watchdog = HangWatchdog(h, run_dir / "hang", env.rank, cfg.train.steps, heartbeat=self.heartbeat)
        self.graphs = (
            GraphWatch(cfg, ledger, env.rank, run_dir, log_metrics, self.heartbeat, attempt.current())
            if ledger is not None
            else None
        )
        self.stragglers = (
            StragglerMonitor(h.straggler_every, log_metrics, model, warn_ratio=h.straggler_warn_ratio)
            if h.straggler_every and env.world_size > 1
            else None
        )

    @property
    def hooks(self) -> list[Callable]:
        """The loop hooks, to run after the checkpoint hook and before fault injection (which may hang the step)."""
        return [m for m in (self.graphs, self.watchdog, self.stragglers) if m is not None]

    def marking(self, timer: Any) -> Any:
        """The step's phase timer for ``fit``, marking each phase on the heartbeat (``timer`` itself without one)."""
        return PhaseMarks(timer, self.heartbeat) if self.heartbeat is not None else timer

    def start(self, step: int) -> None:
        """Training resumes after ``step``: the clock of the next one starts now."""
        if self.watchdog is not None:
            self.watchdog.start(step)  # and the heartbeat
        elif self.heartbeat is not None:
            self.heartbeat.start(step)
        if self.graphs is not None:
            self.graphs.start(step)

    def close(self) -> None:
        """Stop the threads, write the rest of the graph ledger, drop the straggler monitor's group (idempotent)."""
        if self.graphs is not None:
            self.graphs.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.stragglers is not None:
            self.stragglers.close()
            self.stragglers = None
