"""What every layer shares about a training step: its progress, its output, its phase timers, how it ends training.

The loop produces these; backends, metrics, checkpoints and fault injection consume them, so they live below all.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    """Progress that a checkpoint must carry."""

    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Training tokens consumed over all data-parallel ranks."""
    skipped_updates: int = 0
    """Steps whose update was dropped because the gradient norm was not finite (``on_nonfinite=skip_step``)."""
    discarded_batches: list[int] = field(default_factory=list)
    """Steps whose global batch went non-finite and is skipped (``on_nonfinite=rollback``); a resume replays it so."""
    rollbacks: int = 0
    """Times the run went back to its last checkpoint after a non-finite step."""


class HaltedError(RuntimeError):
    """Training stopped on purpose (a non-finite step under ``on_nonfinite=halt``); restarting would not help."""


class NonFiniteError(Exception):
    """The loss or gradient norm of ``step`` was not finite (raised by the hook that noticed it)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step}: the loss or the gradient norm is not finite")
        self.step = step


@dataclass
class StepOutput:
    """What one optimizer step hands to the hooks. Tensors stay on the device."""

    loss: torch.Tensor
    """Mean token loss of the step's global batch on this rank (0-d)."""
    grad_norm: torch.Tensor
    """Global gradient L2 norm before clipping (0-d)."""
    lr: float
    """Learning rate used for this step."""
    data_wait_s: float
    """Host seconds this step spent waiting for batches."""


Hook = Callable[[TrainState, StepOutput], None]

PHASES = ("data_wait", "forward", "backward", "optimizer", "logging", "checkpoint")
"""The phases of a step that ``train.step_breakdown`` times (``time/<phase>_s``); the rest of the step is "other"."""


class StepTimer:
    """Host seconds spent in each phase of the training step, summed until ``take`` (``train.step_breakdown``).

    ``sync`` (``Backend.synchronize``) runs at both ends of every phase, so a phase includes the device work it
    queued; that stalls an accelerator's queue, hence off by default (the neuron backend refuses it outright).
    """

    enabled = True

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self._totals: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block under ``name``."""
        if self.sync is not None:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self._totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` measured elsewhere (the loader wait) under ``name``."""
        self._totals[name] += seconds

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last ``take`` (phases never entered are absent); starts a new sum."""
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals


class NullTimer:
    """The timer when ``train.step_breakdown`` is off: no clock, no synchronization."""

    enabled = False
    _NULL = contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self._NULL

    def add(self, name: str, seconds: float) -> None:
        pass

    def take(self) -> dict[str, float]:
        return {}


NULL_TIMER = NullTimer()
