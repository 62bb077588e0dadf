"""MetricsLogger: one host fetch per log interval, one row per step."""

from __future__ import annotations

import pytest
import torch

from hlat.backends.torch.backend import TorchBackend
from hlat.state import StepOutput, TrainState
from hlat.track.metrics import MetricsLogger
from tests.conftest import backend_config


class CountingBackend(TorchBackend):
    def __init__(self) -> None:
        super().__init__(backend_config())
        self.fetches = 0

    def fetch(self, tensors, fn) -> None:
        self.fetches += 1
        super().fetch(tensors, fn)


def test_fetches_once_per_interval_and_logs_every_step() -> None:
    backend, model, sunk = CountingBackend(), torch.nn.Linear(3, 4, bias=False), []
    with torch.no_grad():
        model.weight.fill_(0.5)  # param norm = sqrt(12 * 0.25)
    logger = MetricsLogger(backend, model, sunk.append, every=4, last_step=10, tokens_per_step=100)
    state = TrainState()
    for step in range(1, 11):
        state.step, state.tokens_seen = step, 100 * step
        logger(state, StepOutput(torch.tensor(10.0 - step), torch.tensor(float(step)), 1e-3 * step, 0.01))
    assert backend.fetches == 3  # steps 4, 8 and the last step 10
    assert [[s for s, _ in rows] for rows in sunk] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    step, last = sunk[1][-1]
    assert step == 8 and last["train/loss"] == 2.0 and last["train/grad_norm"] == 8.0
    assert last["train/lr"] == pytest.approx(8e-3) and last["train/tokens_seen"] == 800
    assert last["train/param_norm"] == pytest.approx(12**0.5 * 0.5)
    assert last["perf/data_wait_s"] == pytest.approx(0.01) and last["perf/tokens_per_s"] > 0
    assert "train/param_norm" not in sunk[1][0][1]  # interval-level metrics only on the interval's last row
