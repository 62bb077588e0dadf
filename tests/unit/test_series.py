"""The Parquet metric series (``hlat.track.series``) and the lean MLflow store beside it, on a real sqlite store."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from hlat.config import TrackerConfig
from hlat.track import compare
from hlat.track.runs import METRIC_KEYS, select_runs
from hlat.track.series import (
    SERIES_DIR,
    LeanTracker,
    SeriesError,
    SeriesWriter,
    read_points,
    read_series,
    store_every,
    to_points,
)
from hlat.track.trackers import History, MLflowTracker, MultiTracker, Rows

STEPS, EVERY = 400, 10


def trainer_rows(first: int, last: int, offset: float = 0.0) -> Rows:
    """The trainer's metric set over ``first..last``: 7 metrics every step, 27 more every ``EVERY`` steps."""
    rows: Rows = []
    for s in range(first, last + 1):
        row = {"train/loss": 10 - s / 100 + offset, "train/grad_norm": 1 + (s % 7) / 10, "train/lr": 1e-3 / s}
        row |= {"spike/active": float(s % 50 == 0), "spike/length": 0.0, "spike/count": s // 50, "spike/limit": 1.5}
        if s % EVERY == 0:
            row |= {"train/param_norm": 40 + s / 100, "perf/tokens_per_s": 1000.0 + s, "perf/step_time_s": 0.5}
            row |= {"sys/peak_rss_gib": 2.0 + s / 1000} | {f"perf/other_{i}": float(i) for i in range(23)}
        rows.append((s, row))
    return rows


def points(directory: Path, key: str) -> dict[int, float]:
    steps, values = to_points(read_series(directory), key)
    return dict(zip(steps.tolist(), values.tolist(), strict=True))


def test_a_restart_leaves_one_value_per_step(tmp_path: Path) -> None:
    """Killed after a checkpoint (twice, once with a clean exit), resumed, rolled back in-process: one value a step,
    the one the surviving history computed."""
    series = tmp_path / SERIES_DIR
    first = SeriesWriter(tmp_path, 0)
    first.log_metrics([(s, {"train/loss": 1000.0 + s}) for s in range(1, 11)])
    first.checkpoint(6)  # then SIGKILLed: steps 7-10 were never written
    second = SeriesWriter(tmp_path, 6)
    second.log_metrics([(s, {"train/loss": 2000.0 + s}) for s in range(7, 11)])
    second.checkpoint(8)
    second.finish("KILLED")  # preempted after step 10, its checkpoint is of step 8: steps 9 and 10 are written too
    assert points(series, "train/loss") == {s: (1000.0 if s <= 6 else 2000.0) + s for s in range(1, 11)}

    third = SeriesWriter(tmp_path, 8)
    third.log_metrics([(s, {"train/loss": 3000.0 + s}) for s in range(9, 13)])
    third.log_metrics([(s, {"train/loss": 4000.0 + s}) for s in range(11, 13)])  # a rollback replays 11 and 12
    third.checkpoint(10)
    assert points(series, "train/loss") == {
        s: (1000.0 if s <= 6 else 2000.0 if s <= 8 else 3000.0) + s for s in range(1, 11)
    }
    third.finish()
    expected = {
        s: (1000.0 if s <= 6 else 2000.0 if s <= 8 else 3000.0 if s <= 10 else 4000.0) + s for s in range(1, 13)
    }
    assert points(series, "train/loss") == expected
    assert [p.name for p in series.iterdir()] == ["compact-000005.parquet"]  # merged at the end (5 parts)


def test_a_damaged_file_is_refused_with_its_name_and_the_way_out(tmp_path: Path) -> None:
    writer = SeriesWriter(tmp_path, 0)
    writer.log_metrics([(s, {"train/loss": float(s)}) for s in range(1, 50)])
    part = writer.checkpoint(49)
    assert part is not None
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # a disk that filled up, a copy cut short
    with pytest.raises(SeriesError, match=rf"metric series file {part} is damaged .*; delete it"):
        read_series(tmp_path / SERIES_DIR)


def test_a_file_with_other_number_types_reads_as_int64_steps_and_float64_values(tmp_path: Path) -> None:
    """Columns are read as views of Arrow's buffers (not pyarrow's ``to_numpy``, which imports pandas): a file that
    another writer made with int32 steps and float32 values is cast first, not reinterpreted."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = pa.DictionaryArray.from_arrays(pa.array([0, 0, 0], pa.int32()), pa.array(["train/loss"]))
    table = pa.table(
        {"key": keys, "step": pa.array([1, 2, 3], pa.int32()), "value": pa.array([0.5, 1.5, -2.0], pa.float32())}
    )
    pq.write_table(table.replace_schema_metadata({b"hlat.keys": b'["train/loss"]'}), tmp_path / "part-000001.parquet")
    steps, values = read_points(tmp_path)["train/loss"]
    assert (steps.dtype, values.dtype) == (np.int64, np.float64)
    assert steps.tolist() == [1, 2, 3] and values.tolist() == [0.5, 1.5, -2.0]


def _tracked_run(uri: str, name: str, rows: Rows, *, lean: bool, root: Path) -> str:
    """A run driven through hlat's trackers: the old way (every point to MLflow) or the lean store plus the series."""
    cfg = TrackerConfig(uri=uri, experiment="series", flush_every_s=600, system_metrics=False)
    ml = MLflowTracker(cfg, name, {})
    if not lean:
        tracker = MultiTracker([ml])
    else:
        writer = SeriesWriter(root, 0)
        writer.upload_with(lambda p: ml.client.log_artifact(ml.run_id, str(p), SERIES_DIR), ml.run_id)
        # A budget of 4 points a metric: the stride of a long run (100 steps), at a unit test's size.
        tracker = MultiTracker([writer, LeanTracker(ml, every=store_every(STEPS, EVERY, budget=4))])
    for i in range(0, len(rows), EVERY):
        tracker.log_metrics(rows[i : i + EVERY])
        if lean and rows[i + EVERY - 1][0] == STEPS // 2:
            writer.checkpoint(STEPS // 2)
    tracker.finish()
    return ml.run_id


def test_compare_reads_the_same_from_the_series_and_the_lean_store_keeps_two_points_a_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the store's artifacts go to ./mlruns
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    rows = trainer_rows(1, STEPS)
    full = _tracked_run(uri, "full", rows, lean=False, root=tmp_path / "full")
    lean = _tracked_run(uri, "lean", rows, lean=True, root=tmp_path / "lean")

    old, new = select_runs(uri, run_ids=[full, lean])
    assert all(len(old.series(k)) > 0 for k in ("train/loss", "train/lr", "train/param_norm", "perf/tokens_per_s"))
    for key in METRIC_KEYS:
        assert new.series(key) == old.series(key), key
    table = compare.summary_table([old, new]).splitlines()
    assert table[2].split("|")[3:] == table[3].split("|")[3:]  # every headline metric, to the digit

    with sqlite3.connect(db) as con:
        counted = dict(con.execute("SELECT run_uuid, COUNT(*) FROM metrics GROUP BY run_uuid").fetchall())
        every_step = {
            k
            for (k,) in con.execute(
                "SELECT key FROM metrics WHERE run_uuid=? GROUP BY key HAVING COUNT(*) = ?", (lean, STEPS)
            )
        }
    assert counted[full] / STEPS > 9 and counted[lean] / STEPS <= 2.5
    assert every_step == {"train/loss", "train/grad_norm"}

    # A damaged series: compare says so and reads the MLflow histories (every step of the loss; the rest thinned).
    (compact,) = (Path(new_run_artifacts(uri, lean)) / SERIES_DIR).glob("compact-*")
    compact.write_bytes(b"not parquet")
    with caplog.at_level(logging.WARNING, logger="hlat.track.runs"):
        (fallback,) = select_runs(uri, run_ids=[lean])
    assert f"{compact.name} is damaged" in caplog.text and "reading its MLflow histories instead" in caplog.text
    assert fallback.series("train/loss") == old.series("train/loss")
    assert len(fallback.series("train/lr")) < STEPS // 50


def new_run_artifacts(uri: str, run_id: str) -> str:
    """The local artifact directory of a run of a sqlite store."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).info.artifact_uri.removeprefix("file://")


def lean(rows: Rows, every: int, first_step: int = 0, *, killed: bool = False) -> dict[str, list[int]]:
    """The steps of each metric :class:`LeanTracker` passes on (``rows`` logged a log interval at a time; ``killed``:
    the process dies after the last, its tracker never finishes)."""
    sent = History(max_rows=len(rows) + 1)
    tracker = LeanTracker(sent, every=every, first_step=first_step)
    for i in range(0, len(rows), EVERY):
        tracker.log_metrics(rows[i : i + EVERY])
    if not killed:
        tracker.finish()
    keys = {key for _, row in rows for key in row}
    return {key: [step for step, _ in sent.series(key)] for key in keys}


def test_the_lean_store_keeps_every_point_of_a_short_run_and_a_fixed_budget_of_a_long_one() -> None:
    assert store_every(60, 10) == store_every(4_500, 10) == 1  # up to the budget: every point
    assert store_every(450_000, 10) == 100  # the paper's run: what bench/tracking_scale.py measured (<= 0.5 GB)
    assert store_every(100_000, 10) == 30  # 23 steps, rounded up to whole log intervals: evenly spaced points
    assert store_every(9_000, 10) == 2  # within a log interval: every interval point, every 2nd per-step one

    short = trainer_rows(1, 60)
    for key, steps in lean(short, store_every(60, EVERY)).items():  # a 60-step arm of a sweep: every point
        assert steps == [s for s, row in short if key in row], key

    budget, rows = 20, trainer_rows(1, STEPS)
    every = store_every(STEPS, EVERY, budget)
    kept = lean(rows, every)
    assert every == EVERY * 2 and kept["train/loss"] == kept["train/grad_norm"] == list(range(1, STEPS + 1))
    assert kept["train/lr"] == [1, *range(every, STEPS + 1, every)]  # evenly spaced; the run's first point too
    assert kept["train/param_norm"] == [EVERY, *range(every, STEPS + 1, every)]
    thinned = [len(steps) for key, steps in kept.items() if key not in ("train/loss", "train/grad_norm")]
    assert max(thinned) == STEPS // every + 1 <= budget + 1  # a window per stride, the first one from step 1


def test_a_resumed_run_keeps_the_points_of_the_uninterrupted_one() -> None:
    """Killed after step 237, resumed from its checkpoint at 200: the attempts together send the uninterrupted
    run's steps (MLflow's outbox drops the replayed ones it holds); without the resume step the second attempt
    would start a window of its own at step 201."""
    rows, every = trainer_rows(1, STEPS), store_every(STEPS, EVERY, budget=20)
    whole = lean(rows, every)
    killed = lean(rows[:237], every, killed=True)
    resumed = lean(rows[200:], every, first_step=200)
    for key in ("train/lr", "spike/limit", "train/param_norm"):
        assert sorted(set(killed[key]) | set(resumed[key])) == whole[key], key
        assert 201 not in resumed[key] and 210 not in resumed[key]


def test_a_long_line_is_plotted_as_its_envelope_spikes_kept() -> None:
    import numpy as np

    steps = np.arange(1, 450_001)
    values = 2 + np.sin(steps / 50.0)
    values[77_776], values[300_000] = 40.0, -3.0  # one-step spikes
    xs, ys = compare._envelope(steps, values, buckets=1000)
    assert len(xs) <= 2000 and (np.diff(xs) > 0).all()
    assert {77_777, 300_001} <= set(xs.tolist()) and ys.max() == 40.0 and ys.min() == -3.0
    short = np.arange(10.0)
    assert compare._envelope(short, short, buckets=1000)[1] is short  # a short line is drawn as it is
