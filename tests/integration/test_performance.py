"""The trainer's own performance instruments: the step-time breakdown, start-up metrics, and torch.compile.

Oracles: the phases are timed inside the interval whose wall time ``perf/step_time_s`` measures, so they cannot add
up to more than it; a checkpoint hook that writes must show in ``time/checkpoint_s``; compiled blocks compute what
eager blocks compute (same parameter names, same loss and gradients within float tolerance).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hlat.backends.torch.backend import TorchBackend
from hlat.config import to_run_config
from hlat.parallel import ParallelDims
from hlat.state import PHASES
from hlat.train.run import main
from tests.conftest import compose_cfg, run_config
from tests.integration.test_train import SMALL_RUN

pytestmark = pytest.mark.slow


def run(tmp_path: Path, cache_dir: Path, *overrides: str):
    cfg = run_config(
        *SMALL_RUN,
        "train.steps=6",
        "train.log_every=2",
        "train.checkpoint_every=2",
        "train.async_checkpoint=false",
        "optimizer.warmup_steps=2",
        f"data.cache_dir={cache_dir}",
        "tracker=console",
        "health=off",
        *overrides,
    )
    return main(cfg, run_dir=tmp_path / "run")


def test_the_step_breakdown_adds_up_to_the_step_time(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    history = run(tmp_path, cache_dir, "train.step_breakdown=true").history
    rows = {step: row for step, row in history.rows if "perf/step_time_s" in row}
    assert sorted(rows) == [2, 4, 6]
    for step, row in rows.items():
        phases = [row[f"time/{p}_s"] for p in PHASES]
        assert all(v >= 0 for v in phases), row
        assert row["time/forward_s"] > 0 and row["time/backward_s"] > 0 and row["time/optimizer_s"] > 0
        # Phases are timed inside the interval perf/step_time_s measures: they cannot exceed it.
        assert sum(phases) <= row["perf/step_time_s"] * 1.001, (step, row)
        assert sum(phases) + row["time/other_s"] == pytest.approx(row["perf/step_time_s"], rel=1e-6, abs=1e-9)
    # A synchronous save after step 2 blocks the loop; hooks after the metrics hook count in the next interval.
    assert rows[4]["time/checkpoint_s"] > 0.005
    # Start-up is logged once per process, with the first row.
    assert (
        [s for s, _ in history.series("perf/startup_s")] == [1] == [s for s, _ in history.series("perf/first_step_s")]
    )
    assert history.series("perf/startup_s")[0][1] > 0 and history.series("perf/first_step_s")[0][1] > 0


def test_compiled_blocks_compute_what_eager_blocks_compute() -> None:
    """train.compile=true: every block's forward is compiled in place; names, loss and gradients are unchanged."""
    cfg = to_run_config(compose_cfg(*SMALL_RUN, "model.n_layers=2", "train.compile=true"))
    models = {}
    for compiled in (False, True):
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compiled))
        backend = TorchBackend(c)
        backend.setup()  # the same seed: the same initial weights
        dims = ParallelDims.build(c.parallelism, 1, c.model, c.train)
        models[compiled] = (backend, backend.build_model(dims))
    (eager_backend, eager), (_, compiled) = models[False], models[True]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), compiled.parameters(), strict=True))
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in compiled.layers)  # compiled in place
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    torch._dynamo.reset()
    losses = [eager_backend.loss(m, tokens[:, :-1], tokens[:, 1:]) for m in (eager, compiled)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # dynamo really traced the blocks
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
