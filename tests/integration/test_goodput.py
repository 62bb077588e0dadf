"""The goodput ledger of a real job: SIGKILLed, then preempted (SIGTERM, exit 85), then requeued to the end.

The oracles: the dead attempt's own record (the step time it had computed past the checkpoint the next attempt resumed
from is the replayed work), the test's own clock (the gap it waited between the kill and the relaunch, the job's wall
time), and the accounting identity (buckets + productive = wall within 1%, per attempt and for the job).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.checkpoint import job_dir
from hlat.launch.preempt import PREEMPTED_EXIT_CODE
from hlat.track.goodput import LOST, Attempt, summarize
from tests.integration.test_preemption import start, stop
from tests.integration.test_train import cli
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
STEPS, EVERY = 24, 4


def args(cache_dir: Path, tmp: Path) -> list[str]:
    """A tiny paced run that checkpoints every 4 steps and writes its ledger at every step."""
    return [
        "model=tiny",
        "model.n_layers=1",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        f"train.steps={STEPS}",
        f"train.checkpoint_every={EVERY}",
        "train.log_every=1",
        "optimizer.warmup_steps=1",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri=sqlite:///{tmp / 'mlflow.db'}",
        "tracker.flush_every_s=0",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "health=off",
        "fault.min_step_s=0.1",  # the signals must find the run still going, however fast
        f"hydra.run.dir={tmp / 'run'}",
    ]


def record(root: Path, number: int, proc: subprocess.Popen, done: Callable[[Attempt], bool]) -> Attempt:
    """Attempt ``number``'s ledger in ``root`` once ``done(record)`` holds (the trainer must still be running)."""
    deadline = time.monotonic() + hang_guard(900)
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the trainer ended (exit {proc.returncode}) before it was signalled"
        records = job_dir.read_attempts(root)
        if len(records) > number and done(attempt := Attempt.from_dict(records[number])):
            return attempt
        time.sleep(0.05)
    raise AssertionError(f"attempt {number} never got there")


def kill_past_a_checkpoint(root: Path, proc: subprocess.Popen) -> tuple[Attempt, int, float]:
    """SIGKILL the trainer between two checkpoints, one complete (steps to replay after it).

    Returns:
        Its last record, the step of its newest complete checkpoint, and when it was killed.
    """
    while True:
        record(root, 0, proc, lambda a: a.last_step > EVERY and a.last_step % EVERY)
        proc.send_signal(signal.SIGSTOP)  # hold it still: the record and checkpoints seen now are its last ones
        dead = Attempt.from_dict(job_dir.read_attempts(root)[0])
        saved = checkpoint.newest_complete(root)
        step = int(saved.name.removeprefix("step_")) if saved is not None else 0
        if 0 < step < dead.last_step:
            proc.kill()
            killed = time.time()
            proc.wait(timeout=hang_guard(60))
            return dead, step, killed
        proc.send_signal(signal.SIGCONT)  # a checkpoint still in flight, or just written: try again a step later
        time.sleep(0.05)


def assert_adds_up(row: dict[str, float], wall: float) -> None:
    """The lost buckets and the productive time make ``wall`` within 1%."""
    assert sum(row[k] for k in LOST) + row["productive_s"] == pytest.approx(wall, rel=0.01), row


def test_the_ledger_of_a_killed_preempted_and_requeued_job(tmp_path: Path, cache_dir: Path) -> None:
    from mlflow import MlflowClient

    command, root = args(cache_dir, tmp_path), tmp_path / "run" / "checkpoints"
    launched = time.time()
    dead, saved, killed = kill_past_a_checkpoint(root, start(command, tmp_path))

    time.sleep(1.0)  # the gap, by the test's clock: at least this long
    proc = start(command, tmp_path)  # the requeue: the same command
    second = record(root, 1, proc, lambda a: a.last_step >= a.resumed_step + 2)
    code, output, _ = stop(proc, signal.SIGTERM, tmp_path)
    assert code == PREEMPTED_EXIT_CODE, output[-4000:]

    done = cli(*command, cwd=tmp_path, timeout=hang_guard(900))
    assert done.returncode == 0, done.stderr[-4000:]
    ended = time.time()

    attempts = [Attempt.from_dict(r) for r in job_dir.read_attempts(root)]
    assert [a.status for a in attempts] == ["running", "preempted", "finished"]
    assert attempts[0] == dead  # nothing wrote the dead attempt's record after its last write
    _, second, third = attempts
    assert third.resumed_step == second.last_step and third.last_step == STEPS  # the preemption lost no step
    rows, total = summarize(attempts)

    # Replayed work: the dead attempt's step time past the checkpoint the next attempt resumed from, by its record.
    assert second.resumed_step == saved < dead.last_step  # the requeue resumed from the dead attempt's checkpoint
    assert rows[0]["replayed_s"] == pytest.approx(dead.steps_s - dead.at_step[saved]) and rows[0]["replayed_s"] > 0
    assert rows[1]["replayed_s"] == 0.0 and rows[2]["replayed_s"] == 0.0
    assert rows[1]["gap_s"] >= 1.0 and second.start - dead.end == rows[1]["gap_s"]  # end: its last record
    assert dead.end <= killed and second.load_s > 0 and third.load_s > 0
    assert all(a.startup_s > 0 and a.save_s > 0 for a in attempts)

    for row in rows:
        assert_adds_up(row, row["wall_s"] + row["gap_s"])
    assert_adds_up(total, total["wall_s"])
    assert total["wall_s"] <= ended - launched  # the ledger's clock is the job's real one
    assert total["ettr"] == pytest.approx(total["productive_s"] / total["wall_s"])

    # The job's ledger in the MLflow run: goodput/* at the last step, and the table artifacts of the final attempt.
    run_id = json.loads((root / "job.json").read_text())["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    latest = client.get_run(run_id).data.metrics
    assert latest["goodput/attempts"] == 3.0
    for key in ("wall_s", "productive_s", "ettr", *LOST):
        assert latest[f"goodput/{key}"] == pytest.approx(total[key], rel=1e-6), key
    assert {"goodput.md", "goodput.json"} <= {f.path for f in client.list_artifacts(run_id)}
    saved = json.loads((tmp_path / "run" / "goodput.json").read_text())
    assert saved["job"] == pytest.approx(total) and len(saved["rows"]) == 3
    print("\n" + (tmp_path / "run" / "goodput.md").read_text())
