"""Cluster health end to end on two gloo ranks: ``hlat doctor``, the trainer's pre-flight check, hangs recovered.

The oracles: the injected slow rank (``health.inject_slow_rank``) is the one named, and nothing else; a hang injected
in a collective (``fault=hang``) ends with stack dumps of both ranks, exit code 75, a restart from the checkpoint
before the hang, and a run that finishes every step in one MLflow run; a rank frozen by SIGSTOP (``fault=sigstop``)
is named, with its host, by the rank that waits for it, never the other way round, and the restart finishes the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_train import ROOT, SMALL_RUN, cli
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
FAST_CHECKS = ["health.matmul_size=256", "health.matmul_seconds=0.1", "health.collective_mib=1"]


def doctor(*args: str, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``hlat doctor`` as a separate process (``python -m hlat.cli.doctor``: the same ``main``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "hlat.cli.doctor", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(600) if timeout is None else timeout,
    )


def train_in_own_group(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python train.py`` in a process group of its own, killed whole on timeout: the ranks of a job that hangs
    (without the watchdog) would otherwise outlive the killed agent."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the hung job was not ended within {timeout:.0f}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table_rows(text: str) -> dict[int, list[str]]:
    """The per-rank rows of the doctor's markdown table, by rank."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 3 and cells[1].isdigit():
            rows[int(cells[1])] = cells
    return rows


def test_doctor_on_two_processes_measures_every_rank_and_notes_the_slow_one(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    r = doctor(
        "cluster=cpu_x2",
        "health.inject_slow_rank=1",
        *FAST_CHECKS,
        f"tracker.uri=sqlite:///{db}",
        "--mlflow",
        "--out",
        str(tmp_path / "doctor.md"),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # one node, no peak: reported, not judged
    rows = table_rows(r.stdout)
    assert sorted(rows) == [0, 1]
    for cells in rows.values():  # matmul TFLOP/s, all-reduce and all-gather GB/s, latency µs: measured, positive
        assert all(float(cells[i]) > 0 for i in (3, 6, 7, 8)), cells
    assert rows[0][-1] == "ok" and rows[1][-1] == "ok"
    assert float(rows[1][3]) < float(rows[0][3])  # the throttled rank measured slower ...
    (note,) = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert re.match(r"note: rank 1 on \S+ measured .* of its node's median", note)  # ... and is named

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("hlat-health").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["hlat.kind"] == "doctor"
    assert run.data.metrics["preflight/passed"] == 1.0 and run.data.metrics["preflight/slowest_rank"] == 1.0
    assert run.data.metrics["preflight/notes"] == 1.0
    assert run.data.metrics["preflight/world_allreduce_busbw_gbps"] > 0
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"doctor.md"}
    assert (tmp_path / "doctor.md").read_text().startswith("# pre-flight check: passed")  # --out


def common(cache_dir: Path, tmp_path: Path) -> list[str]:
    # SMALL_RUN turns health off (as every test whose subject it is not); here it is the subject: back on.
    return [
        *SMALL_RUN,
        "health=default",
        "cluster=cpu_x2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.log_every=2",
        "train.checkpoint_every=4",
        "optimizer.warmup_steps=2",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracker.flush_every_s=0",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        *FAST_CHECKS,
    ]


def test_a_slow_rank_on_one_node_is_reported_and_the_killed_run_restarts(tmp_path: Path, cache_dir: Path) -> None:
    """The incident of issue 21: on one busy host one rank measured far below the other, the pre-flight check
    called it a bad node and refused the restart after a kill. Ranks that share a host are no evidence against it:
    with no peak configured the check reports the slow rank and the run restarts and finishes."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    r = cli(
        *common(cache_dir, tmp_path),
        "train.steps=6",
        "cluster.max_restarts=1",
        "fault.kill_at=[5]",
        "health.inject_slow_rank=1",
        cwd=tmp_path,
        timeout=hang_guard(1200),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    log = (run_dir / "train.log").read_text()
    assert "restart 1 of this job" in out + log  # the pre-flight check of the restart let it go on
    assert (run_dir / "checkpoints" / "step_00000006" / "manifest.json").exists()
    assert re.search(r"pre-flight check: rank 1 on \S+ measured .* of its node's median", log), log[-3000:]
    table = (run_dir / "health" / "preflight.md").read_text()
    assert table.startswith("# pre-flight check: passed") and "reported, not judged (one node)" in table
    assert {cells[-1] for cells in table_rows(table).values()} == {"ok"}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "preflight/passed")] == [1.0, 1.0]
    assert max(client.get_metric_history(run.info.run_id, "uptime/restarts"), key=lambda m: m.step).value == 1.0


def test_a_configured_peak_far_above_the_cpu_stops_training_with_a_health_error(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Held to cluster.peak_tflops, the CPU fails on every rank before the model is built: a health failure (exit 3),
    not a configuration error, not retried, with advice a one-node job can follow."""
    r = cli(
        *common(cache_dir, tmp_path),
        "train.steps=4",
        "cluster.max_restarts=2",
        "cluster.peak_tflops=1000",
        cwd=tmp_path,
        timeout=hang_guard(900),
    )
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    message = next(line for line in r.stderr.splitlines() if line.startswith("hlat: "))
    want = (
        r"hlat: health check failed: pre-flight check failed on 1 of 1 node\(s\): node \S+: rank 0: "
        r"matmul \S+ TFLOP/s is 0% of the expected 1e\+03 \(cluster.peak_tflops"
    )
    assert re.match(want, message), message
    assert "rank 1: matmul" in message and "configuration error" not in r.stderr and "Exclude" not in message
    assert "stop other work on this host's devices and cores" in message and "health.preflight=off" in message
    assert "restart 1 of this job" not in r.stdout + r.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))  # nothing was built, nothing saved
    table = (tmp_path / "run" / "health" / "preflight.md").read_text()
    assert table_rows(table)[1][-1] == "FAIL" and table_rows(table)[0][-1] == "FAIL"


def test_a_hang_in_a_collective_is_dumped_and_the_restart_resumes(tmp_path: Path, cache_dir: Path) -> None:
    """Needs the health hooks in run.py. Rank 1 blocks in an all-reduce after step 6, rank 0 in the gradient
    all-reduce of step 7: both watchdogs fire, dump their stacks and exit 75; elastic restarts the pair from
    step 4, and the run finishes its 10 steps."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    # The watchdog's limits are hang guards too: a busy machine must not look like a hang before step 7.
    first_step_s = hang_guard(300)
    r = train_in_own_group(
        *common(cache_dir, tmp_path),
        "train.steps=10",
        "cluster.max_restarts=1",
        "fault=hang",
        "fault.hang_at=6",
        "health.watchdog_factor=5",
        f"health.watchdog_floor_s={hang_guard(10):g}",
        f"health.watchdog_first_step_s={first_step_s:g}",
        "health.watchdog_grace_s=1",
        "health.straggler_every=2",
        "health.min_relative_fraction=0.05",
        cwd=tmp_path,
        timeout=hang_guard(1200),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]

    log = (run_dir / "train.log").read_text()
    found = re.search(r"Seen by rank \d on \S+: step 7 has run ([\d.]+)s, more than the watchdog's ([\d.]+)s", log)
    assert found, log[-5000:]
    # Both ranks are alive and level after step 6 (rank 1 in the injected all-reduce, rank 0 in the stop agreement):
    # no rank is blamed, the stacks tell.
    reports = [json.loads(x) for x in (run_dir / "hang" / "report.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["suspects"] == [] for r in reports)
    level = "no rank stopped: every rank's heartbeat is fresh and at the same point (after step 6)"
    assert all(r["verdict"].startswith(level) for r in reports), reports
    elapsed, limit = map(float, found.groups())
    assert elapsed >= limit and limit < first_step_s  # the steady-state threshold, not the first-step allowance
    dumps = {p.name: p.read_text() for p in (run_dir / "hang").glob("rank*.txt")}
    assert set(dumps) == {"rank0.txt", "rank1.txt"}  # every rank's stacks, not only the first to notice
    assert "_hang" in dumps["rank1.txt"] and "faults.py" in dumps["rank1.txt"]  # where rank 1 hung
    # Rank 0 waits in a collective for rank 1: the step-end agreement on a stop signal (hlat.launch.preempt, after the
    # fault hook where rank 1 hangs) or, without it, the gradient all-reduce inside the next backward.
    assert "preempt.py" in dumps["rank0.txt"] or "torch/autograd" in dumps["rank0.txt"], dumps["rank0.txt"][-3000:]
    assert all(d.count("hread 0x") >= 2 for d in dumps.values())  # all threads: the stuck one and the watchdog
    assert "restart 1 of this job" in out or "restart 1 of this job" in log
    assert "step_00000004 at step 4" in log  # resumed from the checkpoint before the hang
    assert (run_dir / "checkpoints" / "step_00000010" / "manifest.json").exists()

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")} == set(range(1, 11))
    assert [m.value for m in client.get_metric_history(run.info.run_id, "preflight/passed")] == [1.0, 1.0]
    slowest = client.get_metric_history(run.info.run_id, "health/slowest_rank")
    assert slowest and {m.value for m in slowest} <= {0.0, 1.0}
    assert "preflight.md" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_is_named_by_the_rank_that_waits_for_it(tmp_path: Path, cache_dir: Path, stopped: int) -> None:
    """Issue 33: rank ``stopped`` freezes (SIGSTOP, every thread) after step 6; the other rank blocks in the next
    collective. Only the healthy rank's watchdog can fire, and it must name the stopped rank and its host from the
    heartbeats (torch elastic's store, in the agent), not itself; torch elastic then kills the frozen rank and the
    restart from step 4 finishes the run."""
    run_dir, healthy = tmp_path / "run", 1 - stopped
    # The watchdog's limits are hang guards too; the floor also keeps half the threshold (the staleness bound) far
    # above a live rank's beat period.
    r = train_in_own_group(
        *common(cache_dir, tmp_path),
        "train.steps=10",
        "cluster.max_restarts=1",
        "fault=sigstop",
        "fault.sigstop_at=6",
        f"fault.hang_rank={stopped}",
        "health.watchdog_factor=5",
        f"health.watchdog_floor_s={hang_guard(20):g}",
        f"health.watchdog_first_step_s={hang_guard(300):g}",
        "health.watchdog_grace_s=1",
        "health.straggler_every=0",
        "health.min_relative_fraction=0.05",
        cwd=tmp_path,
        timeout=hang_guard(1200),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    log = (run_dir / "train.log").read_text()
    host = socket.gethostname()
    (line,) = [x for x in log.splitlines() if "hang: " in x]  # one report: the stopped rank cannot write one
    assert re.search(
        rf"hang: rank {stopped} on {re.escape(host)} \(pid \d+\) stopped: last heartbeat [\d.]+s ago, "
        rf".*; rank {healthy} waits .*\. Seen by rank {healthy} on {re.escape(host)}: step 7 has run",
        line,
    )
    assert f"rank {healthy} on {host} (pid" not in line  # the waiting rank is not blamed
    (record,) = [json.loads(x) for x in (run_dir / "hang" / "report.jsonl").read_text().splitlines()]
    assert record["rank"] == healthy and record["suspects"] == [{"rank": stopped, "why": "stopped"}]
    beats = record["beats"]
    assert beats[str(stopped)]["host"] == host and beats[str(stopped)]["step"] <= 6  # its last beat, before the stop
    assert (beats[str(healthy)]["step"], beats[str(healthy)]["phase"]) == (6, "step end")  # in the stop agreement
    assert beats[str(stopped)]["pid"] != beats[str(healthy)]["pid"]
    assert {p.name for p in (run_dir / "hang").glob("rank*.txt")} == {f"rank{healthy}.txt"}
    assert "restart 1 of this job" in out + log and "step_00000004 at step 4" in log
    assert (run_dir / "checkpoints" / "step_00000010" / "manifest.json").exists()
