"""``fit``: the explicit training loop (micro-batch accumulation, clip, step, hooks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from hlat.backends.base import Backend
from hlat.state import NULL_TIMER, Hook, NullTimer, StepOutput, StepTimer, TrainState


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

    def __init__(
        self, data: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int, timer: StepTimer | NullTimer = NULL_TIMER
    ) -> None:
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
    tokens_per_step: int,
    lr_fn: Callable[[int], float],
    hooks: Sequence[Hook] = (),
    grad_hooks: Sequence[Callable[[int, nn.Module], None]] = (),
    timer: StepTimer | NullTimer = NULL_TIMER,
) -> TrainState:
    """Train from ``state.step`` to ``steps``; returns the final state.

    Each step: set the learning rate, run ``grad_accum`` micro-batches (``backend.forward_backward``: loss
    scaled by 1/grad_accum so the gradient is the global-batch mean), clip and step (``backend.update``), then
    call every hook. Nothing here reads a tensor on the host: hooks decide when to fetch. ``grad_hooks`` see
    ``(step, model)`` while the step's gradients exist (after the last backward, before clipping).

    Before a step listed in ``state.discarded_batches`` its global batch is drawn and thrown away. A step whose
    update the backend did not apply (``train.on_nonfinite=skip_step``: its gradient norm was not finite) counts in
    ``state.skipped_updates``; that test reads one flag on the host per step, the only per-step synchronisation.

    ``timer`` (``train.step_breakdown``) times the loader wait, the update (clip, step and ``zero_grad``) and, through
    the micro-batches it hands the backend, forward and backward; hooks are timed by wrapping them (``timed_hook``).

    A hook ends training early by raising at the step boundary: ``hlat.launch.preempt.StopHook`` raises
    ``PreemptedError`` after a signal (``state`` then holds the last completed step, for the caller to checkpoint).
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
            grad_norm, applied = backend.update(model, optimizer)
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
