"""Preemption end to end: real signals from outside to ``python train.py``, unsupervised, supervised and in a sweep.

The oracle is an uninterrupted run: a run stopped by SIGTERM, SIGINT or SIGUSR1 must exit 85 with the checkpoint of
the step in flight, leave its MLflow run KILLED and tagged resumable, and the command it prints must finish it
bitwise equal to the run that was never stopped.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.launch.preempt import MARKER, PREEMPTED_EXIT_CODE
from hlat.train.run import main
from tests.conftest import run_config
from tests.integration.test_fault_recovery import assert_same, state_of, strip_job
from tests.integration.test_train import ROOT, SMALL_RUN, cli
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
STEPS = 40


def common(cache_dir: Path, db: Path) -> list[str]:
    """A short run that checkpoints only at its end: any other checkpoint is the preempted one."""
    return [
        *SMALL_RUN,
        f"train.steps={STEPS}",
        "train.checkpoint_every=0",
        "train.log_every=1",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri=sqlite:///{db}",
        "tracker.flush_every_s=0",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "health=off",
        "fault.min_step_s=0.1",
    ]  # paced: the signal must find the run still going, however fast


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict:
    """The final state of the same run, never stopped."""
    tmp = tmp_path_factory.mktemp("reference")
    main(run_config(*common(cache_dir, tmp / "mlflow.db")), run_dir=tmp / "run")
    return state_of(tmp / "run" / "checkpoints" / f"step_{STEPS:08d}", tmp)


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """``python train.py <args>`` in the background, its output in files of ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:  # the child keeps its copies
        return subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=out, stderr=err
        )


def logged_steps(db: Path, run_id: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, "train/loss"))


def wait_for_steps(proc: subprocess.Popen, db: Path, root: Path, n: int) -> str:
    """Wait until the trainer writing into checkpoint root ``root`` has logged ``n`` steps; its MLflow run id."""
    timeout = hang_guard(900)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the trainer ended (exit {proc.returncode}) before it was signalled"
        run_id = checkpoint.read_job(root).get("mlflow_run_id")  # written once the MLflow run exists
        if run_id and len(logged_steps(db, run_id)) >= n:
            return run_id
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps logged in {timeout:.0f} s")


def stop(proc: subprocess.Popen, sig: int, cwd: Path) -> tuple[int, str, float]:
    """Send ``sig``; the exit code, stdout + stderr, and seconds from the signal to the exit."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=hang_guard(600))
    took = time.monotonic() - t0
    return code, (cwd / "stdout.txt").read_text() + (cwd / "stderr.txt").read_text(), took


def continue_command(output: str) -> list[str]:
    """The overrides of the command the stopped run printed: ``python train.py <overrides>``."""
    line = next(x for x in output.splitlines() if x.startswith("hlat: the run was preempted; to continue it from "))
    words = shlex.split(line.split(": ", 2)[2])
    assert words[:2] == ["python", "train.py"], line
    return words[2:]


def assert_preempted(db: Path, run_id: str, root: Path, output: str, code: int) -> Path:
    """Exit 85, no traceback, the checkpoint of the step in flight, the MLflow run KILLED and resumable."""
    from mlflow import MlflowClient

    assert code == PREEMPTED_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    ckpt = checkpoint.latest(root)
    assert ckpt is not None, output[-4000:]
    step = int(ckpt.name.removeprefix("step_"))
    last_logged = max(logged_steps(db, run_id))
    assert last_logged <= step < STEPS  # nothing lost beyond the step in flight
    run = MlflowClient(f"sqlite:///{db}").get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["hlat.preempted"] == "true" and run.data.tags["hlat.resumable"] == "true"
    assert run.data.tags["hlat.preempted_at_step"] == str(step)
    return ckpt


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_checkpoints_the_step_in_flight_and_the_printed_command_ends_bitwise_equal(
    tmp_path: Path, cache_dir: Path, reference: dict, sig: signal.Signals
) -> None:
    from mlflow import MlflowClient

    db, run_dir = tmp_path / "mlflow.db", tmp_path / "run"
    root = run_dir / "checkpoints"
    proc = start([*common(cache_dir, db), f"hydra.run.dir={run_dir}"], tmp_path)
    run_id = wait_for_steps(proc, db, root, 3)
    code, output, took = stop(proc, sig, tmp_path)
    ckpt = assert_preempted(db, run_id, root, output, code)
    assert json.loads((run_dir / MARKER).read_text())["signal"] == sig.name
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    print(
        f"\n{sig.name}: exit {took:.2f} s after the signal; checkpoint {ckpt.name} {size / 1e6:.1f} MB; "
        + next((x for x in output.splitlines() if "the save took" in x), "").split(" - ")[-1]
    )

    again = cli(*continue_command(output), cwd=tmp_path, timeout=hang_guard(900))
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resumed from {ckpt}" in (run_dir / "train.log").read_text()
    final = state_of(root / f"step_{STEPS:08d}", tmp_path)
    assert_same(strip_job(final), strip_job(reference))  # weights, AdamW state, loader, RNG: bit for bit
    run = MlflowClient(f"sqlite:///{db}").get_run(run_id)
    assert run.info.status == "FINISHED" and "hlat.resumable" not in run.data.tags  # the same run, continued
    assert logged_steps(db, run_id)[-1] == STEPS and not (run_dir / MARKER).exists()


def test_sigterm_to_the_supervising_agent_stops_its_trainer_with_a_checkpoint(tmp_path: Path, cache_dir: Path) -> None:
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "run"
    root = run_dir / "checkpoints"
    proc = start([*common(cache_dir, db), "cluster.max_restarts=1", f"hydra.run.dir={run_dir}"], tmp_path)
    run_id = wait_for_steps(proc, db, root, 3)
    code, output, took = stop(proc, signal.SIGTERM, tmp_path)
    assert_preempted(db, run_id, root, output, code)
    assert "restart 1 of this job" not in output  # stopped, not restarted
    assert "hlat: the run was preempted; to continue it from step_" in output
    print(f"\nsupervised SIGTERM: exit {took:.2f} s after the signal")


def test_an_interrupted_sweep_never_leaves_its_parent_run_running(tmp_path: Path, cache_dir: Path) -> None:
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    proc = start(["-m", *common(cache_dir, db), "tracker.experiment=pre", "optimizer.beta2=0.95,0.99"], tmp_path)
    deadline = time.monotonic() + hang_guard(600)
    while not (roots := list(tmp_path.glob("multirun/*/*/0/checkpoints"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert roots, "job 0 never started"
    run_id = wait_for_steps(proc, db, roots[0], 2)
    code, output, _ = stop(proc, signal.SIGINT, tmp_path)
    assert code == PREEMPTED_EXIT_CODE and "Traceback" not in output, output[-4000:]
    job = json.loads((roots[0].parent / "sweep_job.json").read_text())
    assert job["status"] == "preempted" and job["mlflow_run_id"] == run_id
    client = MlflowClient(f"sqlite:///{db}")
    parent_id = json.loads((roots[0].parent.parent / "sweep.json").read_text())["parent_run_id"]
    assert client.get_run(parent_id).info.status == "KILLED"
    child = client.get_run(run_id)
    assert child.info.status == "KILLED" and child.data.tags["mlflow.parentRunId"] == parent_id
    assert "Run the same sweep command again to continue" in output
    assert not (roots[0].parent.parent / "1").exists()  # the sweep stopped: job 1 never started
