"""The sbatch script that ``hlat launch --target slurm`` renders, run on a real two-node Slurm cluster.

Every job is submitted from an empty environment (``env -i PATH=/usr/bin:/bin``): the script must not need the
submitting shell's venv or working directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.slurm import Cluster

pytestmark = pytest.mark.cluster
HLAT = str(Path(sys.executable).parent / "hlat")
SMALL = [
    "model.n_layers=2",
    "model.dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=352",
    "train.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "optimizer.warmup_steps=2",
    "train.log_every=1",
    "tracker.flush_every_s=0",
    "health=off",
    "tracker.system_metrics=false",
]
PACED = "fault.min_step_s=0.1"
"""Steps of at least 0.1 s: a signal sent a poll (about a second) after the first checkpoint must find the job
still running, however fast the machine."""
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def render(tmp: Path, *overrides: str) -> Path:
    """``hlat launch --target slurm`` run in ``tmp`` (its default MLflow store is ``tmp/mlflow.db``)."""
    out = subprocess.run(
        [HLAT, "launch", "--target", "slurm", "--out", str(tmp), "--run-dir", str(tmp / "run"), *SMALL, *overrides],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def submit_and_wait(cluster: Cluster, script: Path, timeout_s: float, on_running=None) -> tuple[str, str]:
    """Submit from an empty environment, wait for a terminal state; returns (job id, state)."""
    sub = cluster.nodes[0].run(
        ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={script.parent}", "sbatch", "--parsable", str(script)],
        timeout=30,
        cwd=script.parent,
    )
    job = sub.stdout.strip().split(";")[0]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = cluster.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], check=False).stdout.strip()
        state = state.splitlines()[-1].split()[0] if state else ""
        if state in TERMINAL:
            return job, state
        if on_running is not None and state == "RUNNING" and on_running(job):
            on_running = None
        time.sleep(1)
    cluster.run(["scancel", job], check=False)
    out = "\n".join(p.read_text(errors="replace")[-3000:] for p in script.parent.glob("*.out"))
    pytest.fail(f"job {job} not done in {timeout_s} s; output:\n{out}\nslurmctld:\n{cluster.log('slurmctld')[-2000:]}")


def finished_runs(uri: str) -> list:
    """The MLflow runs of experiment hlat in the store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("hlat")
    assert exp is not None, f"no experiment in {uri}"
    return client, client.search_runs([exp.experiment_id])


def check_run(uri: str, steps: int) -> None:
    client, runs = finished_runs(uri)
    assert len(runs) == 1, [r.info.status for r in runs]
    assert runs[0].info.status == "FINISHED"
    loss = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted({m.step for m in loss}) == list(range(1, steps + 1))


def output(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in tmp.glob("*.out"))  # a killed writer may cut a character


def test_sbatch_one_node_trains_into_the_pinned_store(slurm_cluster: Cluster, tmp_path: Path, cache_dir: Path) -> None:
    script = render(tmp_path, "cluster=cpu", "train.steps=6", f"data.cache_dir={cache_dir}")
    assert f"tracker.uri=sqlite:///{tmp_path}/mlflow.db" in script.read_text()
    _, state = submit_and_wait(slurm_cluster, script, 300)
    assert state == "COMPLETED", output(tmp_path)
    check_run(f"sqlite:///{tmp_path}/mlflow.db", 6)


def test_sbatch_two_nodes_trains_into_one_store(slurm_cluster: Cluster, tmp_path: Path, cache_dir: Path) -> None:
    uri = f"sqlite:///{tmp_path}/store/runs.db"
    (tmp_path / "store").mkdir()
    script = render(
        tmp_path, "cluster=cpu", "cluster.nodes=2", "train.steps=6", f"tracker.uri={uri}", f"data.cache_dir={cache_dir}"
    )
    job, state = submit_and_wait(slurm_cluster, script, 300)
    assert state == "COMPLETED", output(tmp_path)
    nodes = slurm_cluster.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "NodeList"]).stdout.split()[-1]
    assert nodes == "n[1-2]"
    check_run(uri, 6)


def test_preempted_job_checkpoints_requeues_and_finishes(
    slurm_cluster: Cluster, tmp_path: Path, cache_dir: Path
) -> None:
    """Slurm's time-limit warning (USR1 to the job steps, as ``--signal=USR1@..`` sends it) mid-run: the trainers
    checkpoint, the script requeues the job, which resumes and finishes into the same MLflow run. The requeued job
    waits the cluster's ``cred_expire`` (10 s, :func:`tests.cluster.slurm.slurm_conf`) before it starts again."""
    steps, every = 100, 20  # the signal lands a few steps after the first checkpoint, well before the last step
    script = render(
        tmp_path,
        "cluster=cpu",
        f"train.steps={steps}",
        f"train.checkpoint_every={every}",
        f"data.cache_dir={cache_dir}",
        f"train.log_every={every}",
        PACED,
    )
    signalled = []

    def preempt(job: str) -> bool:
        if not list((tmp_path / "run").rglob(f"step_{every:08d}")):
            return False
        slurm_cluster.run(["scancel", "--signal=USR1", job])
        signalled.append(time.monotonic())
        return True

    job, state = submit_and_wait(slurm_cluster, script, 300, on_running=preempt)
    log = output(tmp_path)
    assert signalled, log
    assert state == "COMPLETED", log
    assert "preempted with a checkpoint; requeueing" in log
    restarts = slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=1" in restarts, restarts
    client, runs = finished_runs(f"sqlite:///{tmp_path}/mlflow.db")
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert max(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")) == steps


def test_an_administrators_requeue_checkpoints_and_the_job_continues(
    slurm_cluster: Cluster, tmp_path: Path, cache_dir: Path
) -> None:
    """``scontrol requeue`` of a running job (what an administrator or a preempting partition does): Slurm sends
    SIGTERM, the trainers checkpoint the step in flight, and the requeued job resumes from that checkpoint (between
    the regular ones) and finishes into the same MLflow run."""
    steps, every = 100, 20
    script = render(
        tmp_path,
        "cluster=cpu",
        f"train.steps={steps}",
        f"train.checkpoint_every={every}",
        f"data.cache_dir={cache_dir}",
        f"train.log_every={every}",
        "train.keep_last=0",
        PACED,
    )
    requeued = []

    def requeue(job: str) -> bool:
        if not list((tmp_path / "run").rglob(f"step_{every:08d}/manifest.json")):
            return False
        slurm_cluster.run(["scontrol", "requeue", job])
        requeued.append(job)
        return True

    job, state = submit_and_wait(slurm_cluster, script, 300, on_running=requeue)
    log = output(tmp_path)
    assert requeued and state == "COMPLETED", log
    assert "Restarts=1" in slurm_cluster.run(["scontrol", "show", "job", job]).stdout
    stopped = re.search(r"preempted by SIGTERM after step (\d+); checkpoint", log)
    assert stopped, f"the SIGTERM of the requeue must checkpoint the step in flight\n{log[-3000:]}"
    saved = tmp_path / "run" / "checkpoints" / f"step_{int(stopped[1]):08d}" / "manifest.json"
    assert saved.exists() and f"resumed from {saved.parent} at step {stopped[1]}" in log, log[-3000:]
    check_run(f"sqlite:///{tmp_path}/mlflow.db", steps)  # every step once in one run: no hole, no restart
