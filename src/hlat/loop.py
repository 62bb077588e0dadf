"""``fit``: the explicit training loop (micro-batch accumulation, clip, step, hooks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
) -> TrainState:
    """Train from ``state.step`` to ``steps``; returns the final state.

    Each step: set the learning rate, run ``grad_accum`` micro-batches (loss scaled by 1/grad_accum so
    the gradient is the global-batch mean), clip, step, then call every hook. Nothing here reads a
    tensor on the host: hooks decide when to fetch. ``grad_hooks`` see ``(step, model)`` while the step's
    gradients exist (after the last backward, before clipping).
    """
    model.train()
    while state.step < steps:
        lr = lr_fn(state.step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum: torch.Tensor | None = None
        wait = 0.0
        for _ in range(grad_accum):
            t0 = time.perf_counter()
            inputs, targets = next(data)
            wait += time.perf_counter() - t0
            loss = backend.loss(model, inputs, targets) / grad_accum
            loss.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        for grad_hook in grad_hooks:
            grad_hook(state.step + 1, model)
        grad_norm = backend.clip_grad_norm(model, clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        backend.step_end()
        state.step += 1
        state.tokens_seen += tokens_per_step
        out = StepOutput(loss=loss_sum, grad_norm=grad_norm, lr=lr, data_wait_s=wait)
        for hook in hooks:
            hook(state, out)
    return state
