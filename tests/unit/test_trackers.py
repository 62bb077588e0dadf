"""Trackers: MLflow round trip through a local sqlite store, fan-out, rank-0 only."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.config import TrackerConfig
from hlat.track.trackers import History, MLflowTracker, NoopTracker, ProgressBar, build_tracker
from tests.timeouts import hang_guard


def test_off_rank_zero_everything_is_a_noop(tmp_path: Path) -> None:
    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db")
    tracker, ml = build_tracker(cfg, rank=1, run_name="r", tags={}, extra=[History()])
    assert isinstance(tracker, NoopTracker) and ml is None
    assert not (tmp_path / "m.db").exists()


def test_mlflow_round_trip_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db", experiment="exp", flush_every_s=3600)
    history = History()
    tracker, ml = build_tracker(cfg, rank=0, run_name="run-a", tags={"backend": "torch"}, extra=[history])
    assert ml is not None
    calls = []
    real = ml.client.log_batch
    monkeypatch.setattr(ml.client, "log_batch", lambda *a, **k: (calls.append(k), real(*a, **k))[1])

    tracker.log_params({"model.dim": 256, "optimizer.beta2": 0.95, "data.path": None})
    rows = [(s, {"train/loss": 10.0 - s}) for s in range(1, 1501)]
    tracker.log_metrics(rows[:10])
    assert not [c for c in calls if c.get("metrics")]  # buffered, not sent yet
    tracker.log_metrics(rows[10:])  # crosses 1000 points -> flush
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("model: {dim: 256}\n")
    tracker.log_artifact(cfg_file)
    tracker.finish()

    metric_calls = [c for c in calls if c.get("metrics")]
    assert all(len(c["metrics"]) <= 1000 for c in metric_calls) and len(metric_calls) == 2
    client = MlflowClient(tracking_uri=cfg.uri)
    run = client.get_run(ml.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params["optimizer.beta2"] == "0.95" and run.data.tags["backend"] == "torch"
    assert "host" in run.data.tags
    loss = client.get_metric_history(ml.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in loss) == [(s, 10.0 - s) for s in range(1, 1501)]
    assert [a.path for a in client.list_artifacts(ml.run_id)] == ["config.yaml"]
    assert len(history.rows) == 1500 and history.series("train/loss")[0] == (1, 9.0)


def test_failed_status_is_recorded(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db")
    ml = MLflowTracker(cfg, "r", {})
    ml.log_metrics([(1, {"train/loss": 1.0})])
    ml.finish("FAILED")
    client = MlflowClient(tracking_uri=cfg.uri)
    assert client.get_run(ml.run_id).info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(ml.run_id, "train/loss")] == [1.0]
    assert ml.run_id in ml.ui_hint() and "mlflow ui --backend-store-uri" in ml.ui_hint()


def test_history_is_bounded_but_keeps_the_first_row() -> None:
    history = History(max_rows=3)
    history.log_metrics([(s, {"train/loss": float(s)}) for s in range(1, 6)])
    history.log_metrics([(6, {"train/loss": 6.0, "perf/tokens_per_s": 1.0})])
    assert history.series("train/loss") == [(1, 1.0), (4, 4.0), (5, 5.0), (6, 6.0)]
    assert history.series("perf/tokens_per_s") == [(6, 1.0)]
    small = History(max_rows=10)
    small.log_metrics([(1, {"train/loss": 1.0}), (2, {"train/loss": 2.0})])
    assert small.series("train/loss") == [(1, 1.0), (2, 2.0)]  # the first row is not repeated


def test_logging_does_not_wait_for_a_slow_server_and_retries_failures(tmp_path: Path, monkeypatch) -> None:
    import threading

    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db", flush_every_s=0)
    ml = MLflowTracker(cfg, "r", {})
    real, entered, gate, failures = ml.client.log_batch, threading.Event(), threading.Event(), []
    released = threading.Event()

    def slow_then_flaky(*a, **k):
        entered.set()
        if not gate.wait(hang_guard(120)):  # the "server" answers only when the test lets it (a hang guard)
            released.set()  # the guard ran out: the send was not stuck any more when the test looked
        if not failures:
            failures.append(1)
            raise ConnectionError("server hiccup")
        return real(*a, **k)

    monkeypatch.setattr(ml.client, "log_batch", slow_then_flaky)
    ml.log_metrics([(1, {"train/loss": 1.0})])
    assert entered.wait(hang_guard(60))  # the background thread is now stuck in a send
    for step in range(2, 201):
        ml.log_metrics([(step, {"train/loss": float(step)})])
    # 199 calls returned while the send was still stuck: none of them waited for it (had one, it would have waited
    # until the guard released the send). No stopwatch: a busy machine must not fail this.
    assert not gate.is_set() and not released.is_set()
    gate.set()  # the stuck send now fails; its batch goes back to the buffer
    ml.finish()  # and everything is sent here
    client = MlflowClient(tracking_uri=cfg.uri)
    assert sorted(m.step for m in client.get_metric_history(ml.run_id, "train/loss")) == list(range(1, 201))
    assert failures == [1]


def test_the_progress_bar_shows_the_loss_and_ignores_rows_without_one() -> None:
    """Rows of the pre-flight record and the straggler reports reach every tracker; they carry no loss."""
    bar = ProgressBar(total=10, plain=False)  # the tqdm bar (a terminal); plain lines: test_quiet_output.py
    bar.log_metrics([(0, {"preflight/passed": 1.0})])
    bar.log_metrics([(2, {"health/slowest_rank": 1.0})])
    assert not bar.bar.postfix  # nothing was set, and nothing raised
    bar.log_metrics([(1, {"train/loss": 9.0}), (2, {"train/loss": 8.5, "perf/tokens_per_s": 1234.0})])
    assert "loss=8.500" in bar.bar.postfix and "tok_s=1,234" in bar.bar.postfix
    bar.finish()


def test_a_restart_tags_what_changed_since_its_checkpoint_over_the_first_params(tmp_path: Path) -> None:
    """``restart.changed.<key>`` says what the restart itself changed (checkpoint -> now, given as a tag), not the
    first leg's param; a param that changed without such a tag is still recorded against the first value."""
    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db", flush_every_s=3600)
    tracker, ml = build_tracker(cfg, rank=0, run_name="r", tags={}, extra=[])
    tracker.log_params({"train.steps": 4, "model.init_std": 0.02})
    tracker.finish()
    tags = {"restart.changed.train.steps": "8 -> 12"}  # the second leg ran to 8; this third one to 12
    tracker, again = build_tracker(cfg, rank=0, run_name="r", tags=tags, extra=[], run_id=ml.run_id)
    tracker.log_params({"train.steps": 12, "model.init_std": 0.01})
    tracker.finish()
    run = MlflowClient(tracking_uri=cfg.uri).get_run(ml.run_id)
    assert again.run_id == ml.run_id
    assert run.data.tags["restart.changed.train.steps"] == "8 -> 12"
    assert run.data.tags["restart.changed.model.init_std"] == "0.02 -> 0.01"
