"""The trainer's in-run health machinery, built in one place: the hang watchdog and the straggler monitor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from hlat.backends.base import Env
from hlat.config import RunConfig
from hlat.health.stragglers import Rows, StragglerMonitor
from hlat.health.watchdog import HangWatchdog


class Monitors:
    """Loop hooks of ``health``: the watchdog (``health.watchdog``) and stragglers (``health.straggler_every``).

    Build it on every rank at the same point (the straggler monitor creates a process group), ``start`` it right
    before the first step and ``close`` it however training ends.

    Args:
        cfg: The run config (``health``, ``train.steps``).
        env: This rank's place in the job.
        model: The trained module (its forward is timed for the straggler report).
        run_dir: The run directory; stack dumps go to ``<run_dir>/hang``.
        log_metrics: The run's ``tracker.log_metrics`` (a no-op off rank 0).
    """

    def __init__(self, cfg: RunConfig, env: Env, model: nn.Module, run_dir: Path,
                 log_metrics: Callable[[Rows], None]) -> None:  # fmt: skip
        h = cfg.health
        self.watchdog = HangWatchdog(h, run_dir / "hang", env.rank, cfg.train.steps) if h.watchdog else None
        self.stragglers = (
            StragglerMonitor(h.straggler_every, log_metrics, model, warn_ratio=h.straggler_warn_ratio)
            if h.straggler_every and env.world_size > 1
            else None
        )

    @property
    def hooks(self) -> list[Callable]:
        """The loop hooks, to run after the checkpoint hook and before fault injection (which may hang the step)."""
        return [m for m in (self.watchdog, self.stragglers) if m is not None]

    def start(self) -> None:
        """The first step's clock starts now."""
        if self.watchdog is not None:
            self.watchdog.start()

    def close(self) -> None:
        """Stop the watchdog's thread and remove the straggler monitor's hooks and group (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.stragglers is not None:
            self.stragglers.close()
            self.stragglers = None
