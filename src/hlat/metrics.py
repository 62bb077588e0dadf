"""Training metrics: buffered on the device every step, fetched and logged every interval."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from hlat.backends.base import Backend
from hlat.loop import StepOutput, TrainState
from hlat.precision import global_norm

Rows = list[tuple[int, dict[str, float]]]
"""Metric rows ``(step, {name: value})`` in step order."""


def param_norm(model: nn.Module) -> torch.Tensor:
    """Global L2 norm of all parameters, as a device tensor (accumulated in fp32 for bf16 parameters)."""
    return global_norm([p.detach() for p in model.parameters()])


class MetricsLogger:
    """Loop hook: keeps per-step loss and grad norm on the device, logs them every ``every`` steps.

    Each flush makes ONE host transfer (``backend.fetch``) and hands ``sink`` one row per step
    (``train/loss``, ``train/grad_norm``, ``train/lr``); the last row of the interval also carries
    ``train/param_norm`` and the interval's throughput: ``perf/tokens_per_s``, ``perf/step_time_s``,
    ``perf/data_wait_s`` (per step, averaged), ``train/tokens_seen``, plus whatever host values
    ``extra`` returns (the data loader's ``data/*`` statistics).
    """

    def __init__(
        self,
        backend: Backend,
        model: nn.Module,
        sink: Callable[[Rows], None],
        *,
        every: int,
        last_step: int,
        tokens_per_step: int,
        extra: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.backend, self.model, self.sink, self.extra = backend, model, sink, extra
        self.every, self.last_step, self.tokens_per_step = every, last_step, tokens_per_step
        self._steps: list[int] = []
        self._loss: list[torch.Tensor] = []
        self._grad_norm: list[torch.Tensor] = []
        self._lr: list[float] = []
        self._wait = 0.0
        self._t0 = time.perf_counter()

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        self._steps.append(state.step)
        self._loss.append(out.loss)
        self._grad_norm.append(out.grad_norm)
        self._lr.append(out.lr)
        self._wait += out.data_wait_s
        if state.step % self.every == 0 or state.step == self.last_step:
            self._flush(state)

    def _flush(self, state: TrainState) -> None:
        tensors = {
            "loss": torch.stack(self._loss),
            "grad_norm": torch.stack(self._grad_norm),
            "param_norm": param_norm(self.model),
        }
        # Captured by value: on lazy devices ``emit`` runs after later steps have started.
        steps, lrs, wait, tokens_seen = self._steps, self._lr, self._wait, state.tokens_seen
        host = self.extra() if self.extra is not None else {}

        def emit(values: dict[str, list[float]]) -> None:
            # Runs once the values are on the host, so the clock covers the device work of the interval.
            elapsed = time.perf_counter() - self._t0
            self._t0 = time.perf_counter()
            rows: Rows = [
                (s, {"train/loss": loss, "train/grad_norm": gn, "train/lr": lr})
                for s, loss, gn, lr in zip(steps, values["loss"], values["grad_norm"], lrs, strict=True)
            ]
            rows[-1][1].update(
                {
                    "train/param_norm": values["param_norm"][0],
                    "train/tokens_seen": float(tokens_seen),
                    "perf/tokens_per_s": len(steps) * self.tokens_per_step / elapsed,
                    "perf/step_time_s": elapsed / len(steps),
                    "perf/data_wait_s": wait / len(steps),
                    **host,
                }
            )
            self.sink(rows)

        self.backend.fetch(tensors, emit)
        self._steps, self._loss, self._grad_norm, self._lr = [], [], [], []
        self._wait = 0.0
