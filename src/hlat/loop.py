"""``fit``: the explicit training loop (micro-batch accumulation, clip, step, hooks)."""

from __future__ import annotations

import time
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
) -> TrainState:
    """Train from ``state.step`` to ``steps``; returns the final state.

    Each step: set the learning rate, run ``grad_accum`` micro-batches (``backend.forward_backward``: loss
    scaled by 1/grad_accum so the gradient is the global-batch mean), clip and step (``backend.update``), then
    call every hook. Nothing here reads a tensor on the host: hooks decide when to fetch. ``grad_hooks`` see
    ``(step, model)`` while the step's gradients exist (after the last backward, before clipping).

    Before a step listed in ``state.discarded_batches`` its global batch is drawn and thrown away. With
    ``skip_nonfinite`` a step whose gradient norm is not finite makes no update (``state.skipped_updates``); that
    test reads one flag on the host per step, the only per-step synchronisation in the loop.
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
        waits: list[float] = []
        loss = backend.forward_backward(model, _draw(data, grad_accum, waits), grad_accum)
        for grad_hook in grad_hooks:
            grad_hook(state.step + 1, model)
        grad_norm, applied = backend.update(model, optimizer, clip_grad_norm, skip_nonfinite=skip_nonfinite)
        if not applied:
            state.skipped_updates += 1
        optimizer.zero_grad(set_to_none=True)
        backend.step_end()
        state.step += 1
        state.tokens_seen += tokens_per_step
        out = StepOutput(loss=loss, grad_norm=grad_norm, lr=lr, data_wait_s=sum(waits))
        for hook in hooks:
            hook(state, out)
    return state


def _draw(data: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int,
          waits: list[float]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Yield ``n`` batches from ``data`` as they are asked for, appending to ``waits`` the seconds each took."""
    for _ in range(n):
        t0 = time.perf_counter()
        batch = next(data)
        waits.append(time.perf_counter() - t0)
        yield batch
