"""The run's progress on rank 0: a tqdm bar on a terminal, one plain line every N steps in a log file."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class ProgressBar:
    """Progress over optimizer steps with the loss, tokens/s and the ETA: a tracker, and a loop hook.

    A tqdm bar on a terminal; elsewhere, where a bar is one ever-growing line, ``step 40/200 loss 6.120 2,480 tok/s
    eta 4m10s`` every ``every`` steps. ``plain``: force either (None: ``stream.isatty()`` decides).
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        every: int = 10,
        stream: TextIO | None = None,
        plain: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.plain = not _isatty(self.stream) if plain is None else plain
        self.every, self.total, self.n, self.clock = max(1, every), total, initial, clock
        self.last: dict[str, float] = {}
        self._since = (clock(), initial)  # the ETA's rate counts the steps of this process only
        self.bar = (
            None
            if self.plain
            else tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0, file=self.stream)
        )

    def __call__(self, state: Any, out: Any) -> None:  # loop hook: advance without touching the device
        step, self.n = state.step, state.step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        elif step % self.every == 0 or step == self.total:
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        """The plain progress line at the current step."""
        parts = [f"step {self.n}/{self.total}"]
        if "train/loss" in self.last:
            parts.append(f"loss {self.last['train/loss']:.3f}")
        if "perf/tokens_per_s" in self.last:
            parts.append(f"{self.last['perf/tokens_per_s']:,.0f} tok/s")
        t0, step0 = self._since
        if self.n > step0 and self.n < self.total:
            parts.append(f"eta {_duration((self.clock() - t0) / (self.n - step0) * (self.total - self.n))}")
        return " ".join(parts)

    def reset(self) -> None:
        """Start over after a rollback: the bar (or the ETA's rate) restarts from the step restored."""
        if self.bar is not None:
            self.bar.reset(total=self.total)
        self._since = (self.clock(), self.n)

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def log_metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        _, last = rows[-1]
        if "train/loss" not in last:  # rows of other sources (pre-flight, straggler reports) carry no loss
            return
        self.last = {k: last[k] for k in ("train/loss", "perf/tokens_per_s") if k in last}
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{last['train/loss']:.3f}", tok_s=f"{last.get('perf/tokens_per_s', 0):,.0f}", refresh=False
            )

    def finish(self, status: str = "FINISHED") -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for anything without ``isatty``, or closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    """``4m10s``, ``2h05m``, ``12s``: a rounded ETA."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
