"""Cluster health on two real gloo processes, without the trainer: the pre-flight check, the collective timeout, a
hang in a collective caught by both watchdogs, and a straggler named although DP makes every step equally long."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hlat.backends.base import Env
from hlat.backends.torch.dist import Ranks, data_parallel, init_process_group
from hlat.config import ClusterConfig, FaultConfig, HealthConfig, OptimizerConfig, RunConfig
from hlat.health.heartbeat import FileBoard, Heartbeat, PhaseMarks
from hlat.health.preflight import preflight
from hlat.health.report import PreflightError
from hlat.health.stragglers import StragglerMonitor
from hlat.health.watchdog import HANG_EXIT_CODE, HangWatchdog
from hlat.state import NULL_TIMER
from hlat.train.faults import FaultInjector
from tests.integration.test_data_parallel import torchrun_env
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, port: int, timeout_s: float | None = None) -> None:
    """Become rank ``rank`` of a 2-process gloo job, as torchrun's variables would make it."""
    torchrun_env(rank, WORLD, port)
    torch.set_num_threads(1)
    init_process_group(Ranks.from_env(), torch.device("cpu"), timeout_s)


def start_two(target, *args) -> list[multiprocessing.Process]:
    """Start ``target(rank, port, *args)`` in two spawned processes."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def run_two(target, *args, timeout: float | None = None) -> list[int | None]:
    """Run ``target(rank, port, *args)`` in two spawned processes; their exit codes. ``timeout``: a hang guard
    (default ``hang_guard(300)``), after which the processes still alive are killed (exit code None)."""
    timeout = hang_guard(300) if timeout is None else timeout
    procs = start_two(target, *args)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


# --- the pre-flight check ---------------------------------------------------------------------------------------------


def run_config(health: HealthConfig, peak_tflops: float | None = None) -> RunConfig:
    return RunConfig(
        cluster=ClusterConfig(nproc_per_node=2, peak_tflops=peak_tflops),
        optimizer=OptimizerConfig(warmup_steps=0),
        health=health,
    )


def _preflight(rank: int, port: int, out: str) -> None:
    join(rank, port)
    env = Env(rank=rank, world_size=WORLD, device=torch.device("cpu"), memory_budget_bytes=1 << 30)
    fast = {"matmul_size": 128, "matmul_seconds": 0.05, "matmul_repeats": 2, "collective_mib": 0.25}
    slow = HealthConfig(inject_slow_rank=1, **fast)
    result: dict = {}
    report = preflight(run_config(slow), env)  # auto: on for two processes; no peak configured
    result["ranks"] = [(r.rank, r.node, r.matmul_tflops, r.world["allreduce_busbw_gbps"]) for r in report.ranks]
    result["passed"], result["notes"] = report.passed, report.notes
    try:  # a configured peak far above what a CPU does: both ranks fail it
        preflight(run_config(slow, peak_tflops=1000.0), env, out_dir=Path(out).parent / "health")
        result["error"] = None
    except PreflightError as e:
        result["error"] = str(e)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_one_host_reports_its_slow_rank_and_refuses_only_against_a_configured_peak(tmp_path: Path) -> None:
    """Two ranks on this host, rank 1 throttled to 10%: ranks that share a host are not evidence against it, so
    without a configured peak the check reports rank 1 and passes; held to cluster.peak_tflops it fails on every
    rank alike, with advice for a one-node job."""
    out = str(tmp_path / "result")
    assert run_two(_preflight, out) == [0, 0]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    assert results[0]["ranks"] == results[1]["ranks"]  # every rank holds every rank's figures
    assert [r for r, *_ in results[0]["ranks"]] == [0, 1] and len({n for _, n, *_ in results[0]["ranks"]}) == 1
    assert all(tflops > 0 and busbw > 0 for *_, tflops, busbw in results[0]["ranks"])
    (_, _, fast, _), (_, _, slow, _) = results[0]["ranks"]
    assert slow < 0.6 * fast, results[0]["ranks"]  # the throttle worked: the old rank check would have refused
    for r in results:
        assert r["passed"] and len(r["notes"]) == 1 and r["notes"][0].startswith("rank 1 on ")
        assert r["error"] is not None and "rank 0: matmul" in r["error"] and "rank 1: matmul" in r["error"]
        assert "of the expected 1e+03 (cluster.peak_tflops" in r["error"] and "Exclude" not in r["error"]
        assert "stop other work on this host's devices and cores" in r["error"]
        assert "health.preflight=off" in r["error"] and str(tmp_path / "health" / "preflight.md") in r["error"]
    table = (tmp_path / "health" / "preflight.md").read_text()
    assert table.startswith("# pre-flight check: pre-flight check failed on 1 of 1 node(s)")


# --- the collective timeout -------------------------------------------------------------------------------------------


def _timeout(rank: int, port: int, out: str) -> None:
    join(rank, port, timeout_s=5.0)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
            Path(out).write_text("returned")
        except RuntimeError as e:
            Path(out).write_text(f"raised: {e}")
    else:  # alive, but elsewhere, until rank 0 has its outcome (an exit would break rank 0's connection instead)
        deadline = time.monotonic() + hang_guard(300)
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)


def test_the_collective_timeout_comes_from_the_config(tmp_path: Path) -> None:
    """health.collective_timeout_s reaches gloo: a collective nobody joins raises (torch's default: 30 minutes)."""
    out = tmp_path / "outcome"
    # Without the configured 5 s timeout rank 0 would still wait (torch's default: 30 minutes) when both are killed.
    run_two(_timeout, str(out), timeout=hang_guard(120))
    assert out.exists(), "the all-reduce never returned: the configured timeout did not reach gloo"
    assert out.read_text().startswith("raised:") and "timed out" in out.read_text().lower(), out.read_text()


# --- a hang in a collective -------------------------------------------------------------------------------------------


def _hang_worker(rank: int, port: int, tmp: str) -> None:
    join(rank, port)
    # The floor is a hang guard too: a busy machine must not make a step before the injected hang look like one.
    cfg = HealthConfig(
        watchdog_factor=5, watchdog_floor_s=hang_guard(3), watchdog_first_step_s=hang_guard(60), watchdog_grace_s=1.0
    )
    faults = FaultInjector(FaultConfig(hang_at=3, hang_rank=1), steps=8, markers=Path(tmp) / "faults", rank=rank)
    watchdog = HangWatchdog(cfg, Path(tmp) / "hang", rank, last_step=8).start()

    class State:
        step = 0

    state = State()
    while state.step < 8:
        dist.all_reduce(torch.ones(4))  # the step's gradient all-reduce
        state.step += 1
        watchdog(state)
        faults(state, None)  # rank 1 hangs after step 3, in an all-reduce rank 0 never joins
    os._exit(0)  # never reached: the watchdogs end both processes


def test_a_hang_in_a_collective_is_caught_by_every_rank(tmp_path: Path) -> None:
    assert run_two(_hang_worker, str(tmp_path)) == [HANG_EXIT_CODE, HANG_EXIT_CODE]
    dumps = {r: (tmp_path / "hang" / f"rank{r}.txt").read_text() for r in range(WORLD)}
    assert "step 4 has run" in dumps[0] and "step 4 has run" in dumps[1]
    assert "in _hang" in dumps[1] and "faults.py" in dumps[1]  # rank 1: in the injected all-reduce
    assert "in _hang\n" not in dumps[0] and "in _hang_worker" in dumps[0]  # rank 0: in the next step's all-reduce
    assert (tmp_path / "faults" / "hang-3.rank1").exists()  # once per job: a restart runs past it


# --- a rank stopped from outside --------------------------------------------------------------------------------------


def _beating_worker(rank: int, port: int, tmp: str) -> None:
    """Steps of one all-reduce each, for ever, with the watchdog and its heartbeat (files: plain env://)."""
    join(rank, port)
    # The floor is a hang guard, and keeps half the threshold (the staleness bound) far above the beat period.
    limits = {"watchdog_floor_s": hang_guard(20), "watchdog_first_step_s": hang_guard(60)}
    cfg = HealthConfig(watchdog_factor=5, watchdog_grace_s=1.0, **limits)
    heartbeat = Heartbeat(rank, FileBoard(Path(tmp) / "heartbeat", WORLD))
    watchdog = HangWatchdog(cfg, Path(tmp) / "hang", rank, last_step=1 << 30, heartbeat=heartbeat).start()
    marks = PhaseMarks(NULL_TIMER, heartbeat)

    class State:
        step = 0

    state = State()
    while True:  # until the test stops one rank: the other's watchdog ends it, the test kills the stopped one
        with marks.phase("all-reduce"):
            dist.all_reduce(torch.ones(4))
        time.sleep(0.02)
        state.step += 1
        watchdog(state)


@pytest.mark.parametrize("stopped", [0, 1])
def test_the_rank_that_waits_names_the_rank_stopped_from_outside(tmp_path: Path, stopped: int) -> None:
    """SIGSTOP from outside, to each rank in turn (rank 0 hosts the job's store here): the other rank's watchdog
    fires, and its report names the stopped rank, its host and pid from the heartbeat files, not itself."""
    procs, healthy = start_two(_beating_worker, str(tmp_path)), 1 - stopped
    board = FileBoard(tmp_path / "heartbeat", WORLD)
    try:
        deadline = time.monotonic() + hang_guard(300)
        while not all(b is not None and b.step >= 5 for b in board.read().values()):
            assert time.monotonic() < deadline, f"the ranks did not reach step 5: {board.read()}"
            time.sleep(0.05)
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        procs[healthy].join(hang_guard(300))
        assert procs[healthy].exitcode == HANG_EXIT_CODE
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.join()
    (record,) = [json.loads(x) for x in (tmp_path / "hang" / "report.jsonl").read_text().splitlines()]
    assert record["rank"] == healthy and record["suspects"] == [{"rank": stopped, "why": "stopped"}]
    host = socket.gethostname()
    assert record["verdict"].startswith(f"rank {stopped} on {host} (pid {procs[stopped].pid}) stopped: last heartbeat")
    assert f"; rank {healthy} waits in step " in record["verdict"] and "(all-reduce)" in record["verdict"]
    assert record["beats"][str(healthy)]["pid"] == procs[healthy].pid
    report = (tmp_path / "hang" / "report.txt").read_text()
    assert f"rank {healthy} on {host} (pid {procs[healthy].pid}): step " in report and report.count("=== ") == 1
    assert not (tmp_path / "hang" / f"rank{stopped}.txt").exists()


# --- stragglers -------------------------------------------------------------------------------------------------------


class SlowOnRank(torch.nn.Module):
    """A linear layer whose forward sleeps ``delay`` seconds on rank ``slow`` (a slow device or a slow host)."""

    def __init__(self, slow: int, delay: float) -> None:
        super().__init__()
        self.lin, self.slow, self.delay = torch.nn.Linear(8, 8), slow, delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.slow:
            time.sleep(self.delay)
        return self.lin(x)


def _stragglers(rank: int, port: int, out: str) -> None:
    join(rank, port)
    torch.manual_seed(0)
    model = data_parallel(SlowOnRank(slow=1, delay=0.1), torch.device("cpu"), fp32_reduce=False)
    rows: list = []
    monitor = StragglerMonitor(4, rows.extend, model)

    class State:
        step = 0

    class Out:
        data_wait_s = 0.0

    state = State()
    for _ in range(8):
        model(torch.randn(2, 8)).sum().backward()  # DDP: the gradient all-reduce waits for the slow rank
        state.step += 1
        monitor(state, Out())
    monitor.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "last": monitor.last}))
    dist.destroy_process_group()


def test_the_straggler_is_named_though_every_rank_steps_at_its_pace(tmp_path: Path) -> None:
    out = tmp_path / "stragglers.json"
    assert run_two(_stragglers, str(out)) == [0, 0]
    got = json.loads(out.read_text())
    assert [step for step, _ in got["rows"]] == [4, 8]
    for _, m in got["rows"]:
        assert m["health/slowest_rank"] == 1.0
        assert m["health/straggler_lag_s"] > 0.02  # (0.1 s + rank 1's forward - rank 0's) / 2, per step
    (step0, local0, _), (step1, local1, _) = got["last"]
    assert step0 >= 0.1 and step1 >= 0.1  # synchronous DP: rank 0 waits out rank 1's sleep every step ...
    assert local1 >= 0.1 and local0 < local1 - 0.05  # ... but only rank 1 spent it in its own forward
