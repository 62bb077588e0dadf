"""The trainer's in-run health machinery, built in one place: the hang watchdog and its heartbeat, the stragglers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from hlat.backends.base import Env
from hlat.config import RunConfig
from hlat.health.heartbeat import Heartbeat, PhaseMarks, beat_period, board_for
from hlat.health.stragglers import Rows, StragglerMonitor
from hlat.health.watchdog import HangWatchdog
from hlat.launch import attempt


class Monitors:
    """Loop hooks of ``health``: the watchdog and its heartbeat (``watchdog``), the stragglers (``straggler_every``).

    Build it on every rank at the same point (the straggler monitor creates a process group), ``start`` it right
    before the first step and ``close`` it however training ends. Files go under ``<run_dir>/hang`` and
    ``<run_dir>/heartbeat``.
    """

    def __init__(
        self, cfg: RunConfig, env: Env, model: nn.Module, run_dir: Path, log_metrics: Callable[[Rows], None]
    ) -> None:
        h = cfg.health
        self.watchdog: HangWatchdog | None = None
        if h.watchdog:
            board = board_for(env.world_size, run_dir / "heartbeat")
            heartbeat = Heartbeat(env.rank, board, attempt=attempt.current(), every_s=beat_period(env.world_size))
            self.watchdog = HangWatchdog(h, run_dir / "hang", env.rank, cfg.train.steps, heartbeat=heartbeat)
        self.stragglers = (
            StragglerMonitor(h.straggler_every, log_metrics, model, warn_ratio=h.straggler_warn_ratio)
            if h.straggler_every and env.world_size > 1
            else None
        )

    @property
    def hooks(self) -> list[Callable]:
        """The loop hooks, to run after the checkpoint hook and before fault injection (which may hang the step)."""
        return [m for m in (self.watchdog, self.stragglers) if m is not None]

    def marking(self, timer: Any) -> Any:
        """The step's phase timer for ``fit``, marking each phase on the heartbeat (``timer`` itself without one)."""
        return PhaseMarks(timer, self.watchdog.heartbeat) if self.watchdog is not None else timer

    def start(self, step: int) -> None:
        """Training resumes after ``step``: the clock of the next one starts now."""
        if self.watchdog is not None:
            self.watchdog.start(step)

    def close(self) -> None:
        """Stop the watchdog's thread and remove the straggler monitor's hooks and group (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.stragglers is not None:
            self.stragglers.close()
            self.stragglers = None
