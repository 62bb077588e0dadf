"""The outage spool (hlat.track.spool) and the MLflow tracker's use of it, on real files and a real sqlite store.

The end-to-end runs against the team server killed under a trainer: tests/postgres/test_tracking_outage.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hlat.config import TrackerConfig
from hlat.track import spool
from hlat.track.trackers import MLflowTracker
from tests.timeouts import hang_guard


def points(steps: range, key: str = "train/loss") -> list[spool.Point]:
    return [(key, float(s), 1000 + s, s) for s in steps]


def test_a_torn_last_line_is_dropped_and_the_spool_goes_on(tmp_path: Path) -> None:
    """A trainer killed while appending leaves half a line: it is read past, and the next writer cuts it first."""
    path = tmp_path / "run.jsonl"
    s = spool.Spool(path, "run", "http://x")
    s.append(0, points(range(1, 4)))
    s.close()
    with open(path, "ab") as f:
        f.write(b'{"seq":3,"m":[["train/loss",4.0,10')  # killed mid-write: no newline
    torn = spool.read(path)
    assert [p[3] for _, p in torn.points] == [1, 2, 3] and torn.damaged == 1
    again = spool.Spool(path, "run", "http://x")
    again.append(3, points(range(4, 6)))
    again.close()
    healed = spool.read(path)
    assert [(seq, p[3]) for seq, p in healed.points] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert healed.damaged == 0 and healed.next_seq == 5
    with open(path, "ab") as f:  # a torn batch longer than the window the tail is searched in
        f.write(b'{"seq":5,"m":[' + b'["train/loss",1.0,1,6],' * 8000)
    spool.Spool(path, "run", "http://x").close()
    assert spool.read(path).points == healed.points and spool.read(path).damaged == 0


def test_watermarks_leave_only_the_unsent_and_a_drained_spool_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    s = spool.Spool(path, "run", "sqlite:///m.db")
    s.append(0, points(range(1, 11)))
    s.mark_sent(4)
    s.set_meta({"tags": {"a": "b"}, "status": "KILLED", "end_time": 5})
    s.sync()
    left = spool.read(path)
    assert [p[3] for _, p in left.points] == list(range(5, 11)) and left.steps() == "5-10"
    assert left.meta == {"tags": {"a": "b"}, "status": "KILLED", "end_time": 5}
    big = points(range(11, 40_011))  # past the size at which a drained spool is rewritten
    s.append(10, big)
    s.compact({"tags": {}}, 10 + len(big))
    s.close()
    assert path.stat().st_size < 1000
    assert spool.read(path).points == [] and spool.read(path).next_seq == 10 + len(big)


def test_a_spool_stops_at_its_bound(tmp_path: Path) -> None:
    s = spool.Spool(tmp_path / "run.jsonl", "run", "http://x", max_bytes=2000)
    assert s.append(0, points(range(1, 11)))
    assert not s.append(10, points(range(11, 1011)))  # would pass 2000 bytes: nothing written
    s.close()
    assert (tmp_path / "run.jsonl").stat().st_size <= 2000
    assert len(spool.read(tmp_path / "run.jsonl").points) == 10


def test_one_writer_at_a_time_and_sync_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """A live trainer holds its spool: `hlat track sync` refuses it (it would send the points twice). It sends to the
    store the spool names (MLFLOW_TRACKING_URI cannot move a run) and says so."""
    from hlat.cli import main

    path = tmp_path / "mlflow-spool" / "run.jsonl"
    held = spool.Spool(path, "run", f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(spool.SpoolBusyError):
        spool.Spool(path, "run", "x")
    with pytest.raises(SystemExit) as busy:
        main(["track", "sync", str(tmp_path)])
    held.close()
    assert busy.value.code == 1 and f"{path} is in use by another process" in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:
        main(["track", "sync", str(tmp_path / "mlflow-spool" / "x")])
    assert missing.value.code == 2 and "no such file or directory" in capsys.readouterr().err
    with socket.socket() as s:  # a port nothing listens on: the server is still away
        s.bind(("127.0.0.1", 0))
        away = spool.Spool(tmp_path / "away.jsonl", "run", f"http://127.0.0.1:{s.getsockname()[1]}")
    away.append(0, points(range(1, 3)))
    away.close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other.db")
    with pytest.raises(SystemExit) as down:
        main(["track", "sync", str(tmp_path / "away.jsonl")])
    err = capsys.readouterr().err
    assert down.value.code == 1 and "nothing answers at 127.0.0.1" in err
    assert f"MLflow store {away.uri} (from the spool: the store its run logged to)" in err
    assert len(spool.read(tmp_path / "away.jsonl").points) == 2  # kept for the next try


def test_a_continued_run_sends_the_spool_first_and_one_value_per_step(tmp_path: Path) -> None:
    """A restart replays steps MLflow or the spool already hold: they are not sent again (the first value stays),
    and what the previous attempt left in its spool (the server was away) arrives, once."""
    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db", flush_every_s=0, system_metrics=False)
    first = MLflowTracker(cfg, "r", {}, spool_dir=tmp_path / "spool")
    first.log_metrics([(s, {"train/loss": float(s)}) for s in range(1, 11)])
    first.log_metrics([(0, {"preflight/passed": 1.0})])
    first.finish("KILLED")
    assert not first.spool.path.exists()  # everything was sent: nothing kept
    left = spool.Spool(first.spool.path, first.run_id, cfg.uri)  # what an outage at steps 11-14 left
    left.append(0, points(range(9, 15)))  # 9 and 10: sent, but killed before the watermark was written
    part = tmp_path / "part-000001.parquet"  # a series part queued for the run's series/ folder, and a file gone since
    part.write_bytes(b"PAR1")
    artifacts = [[str(part), "series"], str(tmp_path / "gone.txt")]
    left.set_meta({"tags": {"hlat.preempted": "true"}, "artifacts": artifacts, "status": "KILLED", "end_time": 1})
    left.close()

    again = MLflowTracker(cfg, "r", {}, run_id=first.run_id, spool_dir=tmp_path / "spool")
    again.log_metrics([(s, {"train/loss": 100.0 + s}) for s in range(8, 21)])  # replayed from a checkpoint at 7
    again.log_metrics([(0, {"preflight/passed": 0.0})])  # each start's pre-flight record is kept
    again.finish()
    client = MlflowClient(tracking_uri=cfg.uri)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss"))
    assert loss == [(s, float(s)) for s in range(1, 15)] + [(s, 100.0 + s) for s in range(15, 21)]
    assert len(client.get_metric_history(first.run_id, "preflight/passed")) == 2
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["hlat.preempted"] == "true"
    assert [a.path for a in client.list_artifacts(first.run_id, "series")] == ["series/part-000001.parquet"]
    assert not first.spool.path.exists()


def test_a_checkpoint_keeps_the_points_on_disk_while_a_send_is_stuck(tmp_path: Path, monkeypatch) -> None:
    """sync() before a checkpoint writes the unsent points to the spool and returns: it never waits on a send."""
    import threading

    from mlflow import MlflowClient

    cfg = TrackerConfig(uri=f"sqlite:///{tmp_path}/m.db", flush_every_s=0, system_metrics=False)
    ml = MLflowTracker(cfg, "r", {}, spool_dir=tmp_path / "spool")
    real, entered, gate, released = ml.outbox.transport.log_batch, threading.Event(), threading.Event(), []

    def stuck(*a, **k):
        entered.set()
        if not gate.wait(hang_guard(120)):  # the "server" answers only when the test lets it (a hang guard)
            released.append(1)  # the guard ran out: the send was not stuck any more when the test looked
        return real(*a, **k)

    monkeypatch.setattr(ml.outbox.transport, "log_batch", stuck)
    ml.log_metrics([(s, {"train/loss": float(s)}) for s in range(1, 6)])
    assert entered.wait(hang_guard(60))  # the sender is now stuck in a send of steps 1-5
    ml.log_metrics([(6, {"train/loss": 6.0})])
    assert ml.sync() and not released  # returned while the send was stuck
    assert [p[3] for _, p in spool.read(ml.spool.path).points] == [1, 2, 3, 4, 5, 6]  # on disk, fsync'd
    gate.set()
    ml.finish()
    history = MlflowClient(tracking_uri=cfg.uri).get_metric_history(ml.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6] and not ml.spool.path.exists()
