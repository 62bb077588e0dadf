"""The fast suite's end-to-end cover: a micro model through ``run.main``, in-process, a few seconds a run.

``make test`` leaves out the tests marked slow (``make test-slow`` and CI run them). What they prove end to end at
larger sizes, through ``python train.py`` or over two processes, these tests keep in the fast suite on the smallest
run that still shows it: a run lands in MLflow with its metrics and artifacts; a job stopped after step 3 and resumed
continues its MLflow run and its losses bit for bit (so runs are deterministic); each non-finite-step policy does
what it says; and two gloo ranks compute the gradient of the whole batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hlat.track.runs import run_series
from hlat.track.series import read_series, to_points
from hlat.train.run import main
from tests.conftest import run_config
from tests.integration.test_fault_recovery import check_nonfinite_policy

MICRO = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=2",
    "optimizer.decay_steps=4",
    "health=off",
    "tracker.flush_every_s=0",
    "tracker.system_metrics=false",
]
"""~0.1 s a step on 2 CPU cores; 2 micro-batches a step (gradient accumulation). ``decay_steps`` pins the schedule,
so a 3-step leg sees the learning rates of the 6-step run."""


def test_a_run_lands_in_mlflow_and_a_resumed_job_continues_its_run_bit_for_bit(
    tmp_path: Path, cache_dir: Path, monkeypatch
) -> None:
    """Fast cover of test_train.py's slow short-run and resume tests (and of the determinism test it replaces: the
    first leg's losses are the full run's); the one check of a restarted job's uptime (wall = productive + lost)."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    common = [*MICRO, f"data.cache_dir={cache_dir}", f"tracker.uri=sqlite:///{db}"]
    full = main(run_config(*common, "train.steps=6"), run_dir=tmp_path / "full")
    assert full.state is not None and full.state.step == 6 and full.state.tokens_seen == 6 * 4 * 32
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.get_run(full.mlflow_run_id)
    assert run.info.status == "FINISHED"
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]  # every step
    assert not any(k.startswith("time/") for _, row in full.history.rows for k in row)  # no step_breakdown: no timing
    assert loss[0][1] == pytest.approx(math.log(4096), abs=0.3)  # ~ln(vocab) at init
    for key in (
        "train/grad_norm",
        "train/param_norm",
        "train/lr",
        "perf/tokens_per_s",
        "perf/step_time_s",
        "perf/data_wait_s",
        "data/documents_consumed",
        "data/padding_fraction",
    ):
        assert client.get_metric_history(run.info.run_id, key), key
    steps, values = to_points(read_series(tmp_path / "full" / "checkpoints" / "series"), "train/lr")
    lr = dict(zip(steps.tolist(), values.tolist(), strict=True))  # every step in the Parquet series, not in MLflow
    assert lr[2] == pytest.approx(3e-3) and lr[6] < lr[4] < lr[2]  # warm-up, then cosine decay
    assert run.data.params["model.dim"] == "64" and run.data.tags["backend"] == "torch"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "provenance.json", "training.png", "spikes.json"} <= artifacts

    # The same job in two legs: steps 1-3, then resumed to 6 from the step-3 checkpoint.
    first = main(run_config(*common, "train.steps=3"), run_dir=tmp_path / "first")
    assert (tmp_path / "first" / "checkpoints" / "step_00000003" / "manifest.json").is_file()
    second = main(
        run_config(*common, "train.steps=6", f"train.resume={tmp_path / 'first' / 'checkpoints'}"),
        run_dir=tmp_path / "second",
    )
    assert first.history.series("train/loss") == full.history.series("train/loss")[:3]  # deterministic
    assert second.history.series("train/loss") == full.history.series("train/loss")[3:]  # resumed bit for bit
    assert second.mlflow_run_id == first.mlflow_run_id  # one MLflow run for the whole job
    job = client.get_run(first.mlflow_run_id)
    assert job.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(job.info.run_id, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert job.data.tags["restart.changed.train.steps"] == "3 -> 6"
    assert job.data.tags["resumed_from"].endswith("step_00000003")
    series = run_series(client, job, ["train/loss"])  # both legs' Parquet parts, from the run's artifacts
    assert series is not None and list(series["train/loss"]) == full.history.series("train/loss")

    def last(key: str) -> float:
        return max(client.get_metric_history(job.info.run_id, key), key=lambda m: (m.step, m.timestamp)).value

    assert last("uptime/restarts") == 1.0
    wall, productive, lost = last("uptime/wall_s"), last("uptime/productive_s"), last("uptime/lost_s")
    assert wall == pytest.approx(productive + lost) and 0 < productive < wall
    assert last("uptime/pct") == pytest.approx(100 * productive / wall)
    # The job started with the first launch: its wall time covers both processes.
    first_wall = max(m.value for m in client.get_metric_history(job.info.run_id, "uptime/wall_s") if m.step == 3)
    assert wall > first_wall


@pytest.mark.parametrize("policy", ["halt", "rollback", "skip_step"])
def test_non_finite_step_policies(tmp_path: Path, cache_dir: Path, policy: str) -> None:
    """Each non-finite-step policy, once: a NaN gradient at step 4 of 6 (the unsupervised halt's message through the
    command line is test_fault_recovery.py's)."""
    cfg = [
        *MICRO,
        f"data.cache_dir={cache_dir}",
        "tracker=console",
        "tracker.plots=false",
        "train.checkpoint_every=2",
        "train.async_checkpoint=false",
    ]
    result = check_nonfinite_policy(cfg, tmp_path / "run", policy, at=4, steps=6, saved=2)
    if result is not None:  # the steps after the bad one train on finite numbers again
        losses = dict(result.history.series("train/loss"))
        assert all(math.isfinite(losses[s]) for s in (5, 6)), losses
