"""The job record's restart count: every start of the trainer is counted before it can fail (``uptime/restarts``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.train.resume import COUNTED, job_record, record_start


def start(root: Path, launched: float, saved: dict | None = None, resume: str = "auto", survive: bool = True) -> int:
    """One start of the trainer as ``run.main`` makes it: counted first, recorded as a new job after the read-only
    resume checks, then (if it survives start-up) the job record read back and rewritten once tracking is up.
    Returns the restart count this start logs."""
    record_start(root, resume, launched)
    record_start(root, resume, launched, create=True)
    uptime, run_id = job_record(saved or {}, checkpoint.read_job(root) if resume != "never" else {}, launched)
    if survive:
        checkpoint.write_job(root, {"mlflow_run_id": run_id or "run-1", "uptime": uptime.state_dict()})
    return uptime.restarts


@pytest.fixture(autouse=True)
def _rank0(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


def test_restarts_that_die_in_start_up_are_counted(tmp_path: Path) -> None:
    """5 restarts, 2 of which die before the job record used to be written (pre-flight, model build): 5, not 3."""
    root = tmp_path / "checkpoints"
    assert start(root, 100.0) == 0  # the first start of the job
    saved = {"mlflow_run_id": "run-1", "uptime": {"start": 100.0, "productive_s": 40.0, "restarts": 0}}
    assert start(root, 200.0, saved) == 1
    start(root, 300.0, saved, survive=False)  # restart 2 dies in start-up
    start(root, 310.0, saved, survive=False)  # restart 3 too
    assert start(root, 320.0, saved) == 4
    assert start(root, 400.0, saved) == 5
    record = checkpoint.read_job(root)
    assert record["uptime"] == {"start": 100.0, "productive_s": 40.0, "restarts": 5}
    assert record["mlflow_run_id"] == "run-1"  # the restarts continue the same MLflow run


def test_a_job_killed_before_its_first_checkpoint_counts_its_restarts(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    start(root, 100.0, survive=False)  # the first start dies before anything was tracked
    start(root, 110.0, survive=False)
    uptime, run_id = job_record({}, {**checkpoint.read_job(root)}, 120.0)
    assert (uptime.restarts, uptime.start) == (1, 100.0)
    assert start(root, 120.0) == 2 and run_id is None


def test_only_rank_0_counts_and_never_leaves_another_run_alone(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    monkeypatch.setenv("RANK", "1")
    record_start(root, "auto", 100.0)
    assert not root.exists()
    monkeypatch.setenv("RANK", "0")
    (root / "step_00000004").mkdir(parents=True)
    (root / "step_00000004" / "manifest.json").write_text("{}")
    checkpoint.write_job(root, {"mlflow_run_id": "old", "uptime": {"start": 1.0, "productive_s": 2.0, "restarts": 7}})
    before = (root / checkpoint.JOB).read_text()
    record_start(root, "never", 100.0)  # find_resume refuses this directory: its record stays as it is
    assert (root / checkpoint.JOB).read_text() == before
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # an elastic restart of a `never` job resumes it
    record_start(root, "never", 100.0)
    assert json.loads((root / checkpoint.JOB).read_text())["uptime"]["restarts"] == 8


def test_a_record_written_before_this_change_is_read_as_before(tmp_path: Path) -> None:
    """job.json without the start marker: its count does not include the start reading it."""
    latest = {"mlflow_run_id": "r", "uptime": {"start": 5.0, "productive_s": 3.0, "restarts": 2}}
    saved = {"mlflow_run_id": "r", "uptime": {"start": 5.0, "productive_s": 1.0, "restarts": 1}}
    uptime, run_id = job_record(saved, latest, 50.0)
    assert (uptime.restarts, uptime.productive_s, uptime.start, run_id) == (3, 1.0, 5.0, "r")
    uptime, _ = job_record(saved, {**latest, COUNTED: True}, 50.0)
    assert uptime.restarts == 2
    fresh, run_id = job_record({}, {}, 50.0)
    assert (fresh.restarts, fresh.start, run_id) == (0, 50.0, None)
