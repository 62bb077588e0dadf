"""A Hydra sweep through ``hydra/launcher=slurm`` (submitit) on the real two-node Slurm cluster, one job cancelled.

The sweep's two jobs run as a Slurm job array, one per node. Job 1 hangs after its checkpoint of step 4 (a stuck
trainer, ``fault.hang_at``) and is ``scancel``-ed; the sweep must still compare job 0, name the cancelled job, exit 1
and close its MLflow parent run; running the same sweep again skips job 0 and continues job 1 from its checkpoint into
the same MLflow run. Before ``hlat.sweep.launcher``, submitit's ``UncompletedJobError`` ended the sweep with a
stack trace, no comparison, and the parent run left RUNNING.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.slurm import Cluster
from tests.integration.test_sweeps import FAST, new_sweep, records

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("HLAT_TEST_TIMEOUT_SCALE", "1")) * 300
"""A hang guard for each sweep, not a speed requirement (a sweep takes ~1 minute here)."""


def sweep(cluster: Cluster, tmp: Path, cache_dir: Path, *extra: str) -> subprocess.Popen:
    """Start the sweep on the first node (where ``sbatch`` reaches the controller), output in ``tmp/sweep-N.log``."""
    argv = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        *FAST,
        f"data.cache_dir={cache_dir}",
        "train.steps=4,6",
        f"tracker.uri=sqlite:///{tmp / 'mlflow.db'}",
        "hydra/launcher=slurm",
        *extra,
    ]
    log = tmp / f"sweep-{len(list(tmp.glob('sweep-*.log')))}.log"
    return cluster.nodes[0].popen(argv, cwd=tmp, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait(p: subprocess.Popen, tmp: Path) -> str:
    try:
        p.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"the sweep did not end in {TIMEOUT_S:.0f} s\n{logs(tmp)}")
    return logs(tmp)


def logs(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-6000:] for p in sorted(tmp.glob("sweep-*.log")))


def cancel_when_hanging(cluster: Cluster, p: subprocess.Popen, tmp: Path) -> str:
    """``scancel`` job 1's array task once its trainer hangs (after the checkpoint of step 4); returns its id."""
    deadline = time.monotonic() + TIMEOUT_S
    while not list(tmp.glob("multirun/*/*/1/checkpoints/faults/hang-*")):
        assert p.poll() is None and time.monotonic() < deadline, f"job 1 never reached its hang\n{logs(tmp)}"
        time.sleep(0.5)
    tasks = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    task = next(t for t in tasks if t.endswith("_1"))
    cluster.run(["scancel", task])
    return task


def test_a_cancelled_job_fails_the_sweep_after_the_others_and_continues_when_run_again(
    slurm_cluster: Cluster, tmp_path: Path, cache_dir: Path
) -> None:
    from mlflow import MlflowClient

    t0 = time.monotonic()
    first_run = sweep(slurm_cluster, tmp_path, cache_dir, "fault.hang_at=5", "fault.hang_rank=0")
    task = cancel_when_hanging(slurm_cluster, first_run, tmp_path)
    text = wait(first_run, tmp_path)
    print(f"\nsweep with job {task} cancelled: {time.monotonic() - t0:.1f} s")
    assert first_run.returncode == 1, text  # it survived the cancel, compared, then failed
    seen: set[Path] = set()
    first = new_sweep(tmp_path, seen)
    rec = records(first)
    assert rec["0"]["status"] == "finished" and rec["1"]["status"] in ("killed", "preempted"), rec
    assert "did not finish: 1 " in text and "/1/train.log" in text, text  # named, with its logs
    assert "| train.steps=4 |" in text and "| train.steps=6 |" in text  # compared; runs named by their overrides
    assert state(slurm_cluster, task) == "CANCELLED"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(json.loads((first / "sweep.json").read_text())["parent_run_id"])
    cancelled = client.get_run(rec["1"]["mlflow_run_id"])
    assert parent.info.status in ("KILLED", "FAILED") and cancelled.info.status == "KILLED"  # never left RUNNING

    t0 = time.monotonic()
    again = sweep(slurm_cluster, tmp_path, cache_dir)  # the fault is not part of the job's identity
    text = wait(again, tmp_path)
    print(f"the same sweep again: {time.monotonic() - t0:.1f} s")
    assert again.returncode == 0, text
    rec2 = records(new_sweep(tmp_path, seen))
    assert rec2["0"]["status"] == "skipped" and rec2["1"]["decision"]["action"] == "resume", rec2
    assert rec2["1"]["status"] == "finished" and rec2["1"]["mlflow_run_id"] == cancelled.info.run_id  # the same run
    steps = sorted({m.step for m in client.get_metric_history(cancelled.info.run_id, "train/loss")})
    assert steps == [1, 2, 3, 4, 5, 6] and client.get_run(cancelled.info.run_id).info.status == "FINISHED"


def state(cluster: Cluster, job: str) -> str:
    """The job's state in Slurm's accounting."""
    out = cluster.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"]).stdout.split()
    return out[0] if out else ""
