"""``fit``: the explicit training loop (micro-batch accumulation, clip, step, hooks)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hlat.backends.base import Backend


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
    """Steps whose first global batch is thrown away before training (``on_nonfinite=rollback``: the batch that
    went non-finite). Kept in checkpoints, so a resumed run replays the same data."""
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

    ``sync`` (``Backend.synchronize``: CUDA's synchronize, nothing on the CPU) runs at both ends of every phase, so
    a phase's time includes the device work it queued. That stalls an accelerator's queue: hence off by default.
    (The neuron backend refuses it: synchronizing would cut its traced step graph.)
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


def timed_hook(timer: StepTimer | NullTimer, name: str, hook: Hook) -> Hook:
    """``hook`` with its calls timed as the phase ``name`` (``logging``, ``checkpoint``)."""

    def run(state: TrainState, out: StepOutput) -> None:
        with timer.phase(name):
            hook(state, out)

    return run


class MicroBatches:
    """The ``n`` micro-batches of one step, drawn from the loader as the backend asks for them.

    ``waits`` collects the seconds each draw took; ``timer`` is the step's phase timer, for the backend to time
    forward and backward with (``timer.phase("forward")``) without knowing whether timing is on.
    """

    def __init__(self, data: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int,
                 timer: StepTimer | NullTimer = NULL_TIMER) -> None:  # fmt: skip
        self.data, self.n, self.timer = data, n, timer
        self.waits: list[float] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.n):
            t0 = time.perf_counter()
            batch = next(self.data)
            self.waits.append(time.perf_counter() - t0)
            yield batch


def fit(
    state: TrainState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    backend: Backend,
    *,
    steps: int,
    grad_accum: int,
    clip_grad_norm: float,
    tokens_per_step: int,
    lr_fn: Callable[[int], float],
    hooks: Sequence[Hook] = (),
    grad_hooks: Sequence[Callable[[int, nn.Module], None]] = (),
    skip_nonfinite: bool = False,
    timer: StepTimer | NullTimer = NULL_TIMER,
) -> TrainState:
    """Train from ``state.step`` to ``steps``; returns the final state.

    Each step: set the learning rate, run ``grad_accum`` micro-batches (``backend.forward_backward``: loss
    scaled by 1/grad_accum so the gradient is the global-batch mean), clip and step (``backend.update``), then
    call every hook. Nothing here reads a tensor on the host: hooks decide when to fetch. ``grad_hooks`` see
    ``(step, model)`` while the step's gradients exist (after the last backward, before clipping).

    Before a step listed in ``state.discarded_batches`` its global batch is drawn and thrown away. With
    ``skip_nonfinite`` a step whose gradient norm is not finite makes no update (``state.skipped_updates``); that
    test reads one flag on the host per step, the only per-step synchronisation in the loop.

    ``timer`` (``train.step_breakdown``) times the loader wait, the update (clip, step and ``zero_grad``) and, through
    the micro-batches it hands the backend, forward and backward; hooks are timed by wrapping them (``timed_hook``).

    A hook ends training early by raising at the step boundary: ``hlat.train.preempt.StopHook`` raises ``PreemptedError``
    after a signal (``state`` then holds the last completed step, for the caller to checkpoint).
    """
    model.train()
    discard = set(state.discarded_batches)
    while state.step < steps:
        if state.step + 1 in discard:
            for _ in range(grad_accum):
                next(data)
        lr = lr_fn(state.step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = MicroBatches(data, grad_accum, timer)
        loss = backend.forward_backward(model, batches, grad_accum)
        timer.add("data_wait", sum(batches.waits))
        for grad_hook in grad_hooks:
            grad_hook(state.step + 1, model)
        with timer.phase("optimizer"):
            grad_norm, applied = backend.update(model, optimizer, clip_grad_norm, skip_nonfinite=skip_nonfinite)
            optimizer.zero_grad(set_to_none=True)
        if not applied:
            state.skipped_updates += 1
        backend.step_end()
        state.step += 1
        state.tokens_seen += tokens_per_step
        out = StepOutput(loss=loss, grad_norm=grad_norm, lr=lr, data_wait_s=sum(batches.waits))
        for hook in hooks:
            hook(state, out)
    return state
