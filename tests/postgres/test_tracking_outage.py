"""The team tracking server (``scripts/mlflow-server.sh``, MLflow on PostgreSQL) killed (SIGKILL) under
``python train.py``: tracking never holds training, loses nothing, and a restart leaves one value per step.

The outage is the realistic one: MLflow's server process group dies, its PostgreSQL keeps running, and the script
starts again on the same database, artifact root and port. The module's tests share one such server
(:func:`tests.postgres.conftest.script_server`), on a database of its own.

The trainers run with MLflow's own HTTP retries made pathologically long (:data:`SLOW_RETRIES`: seven retries at
the largest backoff MLflow allows, ~14 minutes a request): a step, checkpoint or preemption that waited on MLflow
while its server is away would blow the hang guard or ``train.preempt_grace_s``, where a run that never waits ends as
a healthy one does. The counts come from MLflow itself: every step's ``train/loss`` once, none missing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.launch.preempt import PREEMPTED_EXIT_CODE
from hlat.track.spool import find, send
from hlat.train.tracking import SPOOL_DIR
from tests.integration.mlflow_ui import ROOT
from tests.integration.test_preemption import continue_command, stop
from tests.postgres.conftest import ScriptServer
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
SLOW_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "120"}
TINY = [
    "model.n_layers=1",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "train.checkpoint_every=5",
    "train.async_checkpoint=false",
    "optimizer.warmup_steps=1",
    "tracker.flush_every_s=0",
    "tracker.plots=false",
    "tracker.system_metrics=false",
    "health=off",
]
SAMPLED = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5", "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "1"}
"""System metrics every 0.5 s (a mean of one sample each), where a run logs one every 5 min."""
UNSENT = re.compile(
    r"MLflow at \S+ did not answer: (\d+) points \(steps (\d+)-(\d+)\).* were not sent; they are kept in (\S+)\."
)


def train(args: list[str], cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python train.py`` in the background, MLflow's retries slowed (:data:`SLOW_RETRIES`), output in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **SLOW_RETRIES, **(extra_env or {})}
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=out, stderr=err
        )


def output(cwd: Path) -> str:
    return (cwd / "stdout.txt").read_text() + (cwd / "stderr.txt").read_text()


def losses(uri: str, run_id: str) -> list[tuple[int, float]]:
    """Every ``train/loss`` point MLflow holds, by step (a step logged twice appears twice)."""
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "train/loss"))


def system_points(uri: str, run_id: str) -> list[tuple[int, int]]:
    """``(timestamp ms, step)`` of every CPU utilization point (one of the system metrics) MLflow holds, by time."""
    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(run_id, "system/cpu_utilization_percentage")
    return sorted((m.timestamp, m.step) for m in history)


def wait_until(what: str, proc: subprocess.Popen | None, done) -> None:
    """Poll ``done()`` until true; the trainer ``proc`` must still be running meanwhile (a hang guard bounds it)."""
    deadline = time.monotonic() + hang_guard(600)
    while not done():
        assert proc is None or proc.poll() is None, f"the trainer ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {hang_guard(600):.0f} s"
        time.sleep(0.2)


def logged(uri: str, root: Path, proc: subprocess.Popen, n: int) -> str:
    """Wait until the trainer with checkpoint root ``root`` has ``n`` losses in MLflow; its run id."""
    run: list[str] = []

    def enough() -> bool:
        run_id = checkpoint.read_job(root).get("mlflow_run_id") if (root / "job.json").exists() else None
        run[:] = [run_id] if run_id else []
        return bool(run_id) and len(losses(uri, run_id)) >= n

    wait_until(f"{n} losses in MLflow", proc, enough)
    return run[0]


def last_checkpoint(root: Path) -> int:
    ckpt = checkpoint.latest(root)
    return int(ckpt.name.removeprefix("step_")) if ckpt is not None else 0


@pytest.fixture
def server(script_server: ScriptServer) -> ScriptServer:
    """The module's team server, running (started again if a test before failed while it was down)."""
    return script_server if script_server.running else script_server.start()


@pytest.fixture(scope="module")
def killed_for_good(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, script_server: ScriptServer) -> dict:
    """A 30-step run whose server is SIGKILLed after its third loss and restarted only once the run ended."""
    tmp = tmp_path_factory.mktemp("for-good")
    base, run_dir = script_server.uri, tmp / "run"
    args = [*TINY, "train.steps=30", "fault.min_step_s=0.1", f"data.cache_dir={cache_dir}", f"tracker.uri={base}"]
    proc = train([*args, f"hydra.run.dir={run_dir}"], tmp)
    try:
        run_id = logged(base, run_dir / "checkpoints", proc, 3)
        script_server.kill()
        code = proc.wait(hang_guard(600))
    finally:
        if proc.poll() is None:
            proc.kill()
    text = output(tmp)
    script_server.start()
    (spool,) = find(run_dir)
    sync = send(spool)  # `hlat track sync RUN_DIR` (its command line: tests/unit/test_spool.py)
    from mlflow import MlflowClient

    status = MlflowClient(base).get_run(run_id).info.status
    return {"code": code, "output": text, "sync": sync, "losses": losses(base, run_id), "status": status}


def test_a_server_killed_for_good_holds_nothing_up_and_sync_sends_every_point(killed_for_good: dict) -> None:
    run = killed_for_good
    assert run["code"] == 0 and "Traceback" not in run["output"], run["output"][-4000:]
    (unsent,) = UNSENT.findall(run["output"])  # one line: how many points, which steps, where they are kept
    n, last, spool = int(unsent[0]), int(unsent[2]), Path(unsent[3])
    assert last == 30 and n > 0 and spool.parent.name == SPOOL_DIR
    # A request in flight at the SIGKILL may have been stored unanswered: the sync skips what MLflow holds already
    (sent,) = re.findall(r"^sent (\d+) points \(steps (\d+)-30\), .*status FINISHED", run["sync"])
    assert 0 < int(sent[0]) <= n and int(sent[1]) >= int(unsent[1]), (run["sync"], unsent)
    assert [step for step, _ in run["losses"]] == list(range(1, 31))  # none lost, none doubled
    assert run["status"] == "FINISHED" and not spool.exists()


def test_a_short_outage_loses_nothing_and_a_sigterm_in_an_outage_stops_within_the_grace(
    tmp_path: Path, cache_dir: Path, server: ScriptServer
) -> None:
    """Down for two checkpoints, back: the points arrive in the same run while it trains, and so do the system
    metrics, sampled through the outage and after it (MLflow's own monitor ended at the first failed request). Down
    again, SIGTERM: exit 85 within ``train.preempt_grace_s``; the resume sends the spool first, every step has one
    loss and every system metric sample one step.

    The trainer is SIGSTOPped while the server restarts (seconds on a busy machine), so that however long that
    takes, the run is still training when it is back.
    """
    from mlflow import MlflowClient

    base, run_dir = server.uri, tmp_path / "run"
    root = run_dir / "checkpoints"
    args = [*TINY, "train.steps=60", "fault.min_step_s=0.2", f"data.cache_dir={cache_dir}", f"tracker.uri={base}"]
    args = [a if a != "tracker.system_metrics=false" else "tracker.system_metrics=true" for a in args]
    proc = train([*args, f"hydra.run.dir={run_dir}"], tmp_path, SAMPLED)
    try:
        run_id = logged(base, root, proc, 3)
        server.kill()
        down_ms, down_at = time.time() * 1000, last_checkpoint(root)
        wait_until("two checkpoints in the outage", proc, lambda: last_checkpoint(root) >= down_at + 10)
        proc.send_signal(signal.SIGSTOP)
        through = last_checkpoint(root)
        server.start()
        back_ms = time.time() * 1000
        proc.send_signal(signal.SIGCONT)
        wait_until(
            "the outage's points in MLflow",
            proc,
            lambda: [s for s, _ in losses(base, run_id)][:through] == list(range(1, through + 1)),
        )
        after = lambda: any(t > back_ms for t, _ in system_points(base, run_id))  # noqa: E731
        wait_until("system metrics sampled after the restart", proc, after)
        assert any(down_ms < t < back_ms for t, _ in system_points(base, run_id))  # sampled in the outage: kept
        server.kill()
        assert proc.poll() is None, "the trainer ended before the second outage"
        code, text, _ = stop(proc, signal.SIGTERM, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == PREEMPTED_EXIT_CODE and "Traceback" not in text, text[-4000:]
    assert "stopped" in text and "more than train.preempt_grace_s" not in text, text[-4000:]
    assert len(UNSENT.findall(text)) == 1, text[-4000:]
    server.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    unpaced = [w if not w.startswith("fault.min_step_s=") else "fault.min_step_s=0" for w in continue_command(text)]
    again = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *unpaced],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(900),
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert [s for s, _ in losses(base, run_id)] == list(range(1, 61))  # one run, every step once
    samples = [step for _, step in system_points(base, run_id)]
    assert sorted(samples) == list(range(len(samples)))  # numbered on across the outages and the resume
    run = MlflowClient(base).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["hlat.preempted"] == "true"
    assert "hlat.resumable" not in run.data.tags


def test_a_killed_and_resumed_run_has_one_loss_per_step_equal_to_an_uninterrupted_run(
    tmp_path: Path, cache_dir: Path, killed_for_good: dict, server: ScriptServer
) -> None:
    """SIGKILLed at step 14, four steps after its last checkpoint: the resume (the same command: the fault fires once
    a job) replays 11-14, which MLflow holds already; each step is sent once, with the uninterrupted run's value."""
    args = [
        *TINY,
        "train.steps=30",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri={server.uri}",
        f"hydra.run.dir={tmp_path}/run",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "fault.kill_at=[14]", "fault.min_step_s=0.1"]  # fires once
    killed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=hang_guard(600))
    assert killed.returncode == -signal.SIGKILL
    run_id = checkpoint.read_job(tmp_path / "run" / "checkpoints")["mlflow_run_id"]
    assert [s for s, _ in losses(server.uri, run_id)][-1] >= 11  # logged ahead of the checkpoint at 10
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_guard(600))
    assert again.returncode == 0, again.stderr[-4000:]
    assert losses(server.uri, run_id) == killed_for_good["losses"]  # one per step, bit for bit the uninterrupted run's
