"""Cluster health in one process: the verdict and report, the Neuron tool parsers, the watchdog's logic, the config."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from hlat.config import ConfigError, FaultConfig, HealthConfig, to_run_config
from hlat.health import checks
from hlat.health.neuron_tools import ToolResult, nccom_test, neuron_ls, parse_nccom_test, parse_neuron_ls
from hlat.health.preflight import node_ranks, reference_peak
from hlat.health.report import JOB, HealthReport, RankResult, evaluate, node_medians, observations
from hlat.health.stragglers import straggler_metrics
from hlat.health.watchdog import HANG_EXIT_CODE, HangWatchdog, py_spy_dump
from hlat.train.faults import FaultInjector
from tests.conftest import compose_cfg
from tests.timeouts import hang_guard

# nccom-test's documented output (Neuron SDK docs, tools/neuron-sys-tools/nccom-test.rst): bandwidths in GiB/s.
NCCOM_OK = """     size(B)    count(elems)     type    time(us)    algbw(GB/s)    busbw(GB/s)
    33554432        33554432    uint8         768          40.69          40.69
Avg bus bandwidth:      40.6901GB/s
"""
NCCOM_FAILED = """     size(B)    count(elems)    type    time(us)    algbw(GB/s)    busbw(GB/s)
    33554432    Failure running neuron-bench - log file /tmp/nccom_test_log_7pqpdfjf.log
1 errors found - test failed
"""
# neuron-ls --json-output on a trn1.2xlarge (one device, two NeuronCores, memory in bytes).
NEURON_LS = json.dumps(
    [
        {
            "neuron_device": 0,
            "bdf": "0000:00:1e.0",
            "cpu_affinity": "0-7",
            "numa_node": "-1",
            "connected_to": None,
            "nc_count": 2,
            "memory_size": 34359738368,
            "neuroncore_ids": [0, 1],
            "neuron_processes": [],
        }
    ]
)


def rank(r: int, node: str = "a", tflops: float = 100.0, expected: float | None = None, **kw) -> RankResult:
    return RankResult(
        r,
        node,
        r % 2,
        "cuda",
        kw.pop("ok", True),
        kw.pop("note", "fine"),
        tflops,
        expected,
        "cluster.peak_tflops" if expected else "none known",
        **kw,
    )


def figures(bw: float) -> dict[str, float]:
    return {"allreduce_busbw_gbps": bw, "allgather_busbw_gbps": bw / 2, "latency_us": 30.0}


# --- the verdict ------------------------------------------------------------------------------------------------------


def ranks_at(where: list[tuple[str, int]], tflops: list[float], expected: float | None = None) -> list[RankResult]:
    """What ``run_checks`` gathers: rank ``r`` on host ``where[r][0]`` (local rank ``where[r][1]``) measured
    ``tflops[r]``."""
    return [
        RankResult(r, host, local, "cpu", True, "fine", t, expected, "cluster.peak_tflops" if expected else "none")
        for r, ((host, local), t) in enumerate(zip(where, tflops, strict=True))
    ]


def test_nodes_not_ranks_are_compared_and_a_slow_host_is_named() -> None:
    where = [("h1", 0), ("h1", 1), ("h2", 0), ("h2", 1)]
    assert node_ranks(where) == {"h1": [0, 1], "h2": [2, 3]}
    cfg = HealthConfig(min_relative_fraction=0.6)
    # h1: one busy rank (30 of its node's 65) is no evidence against the node; h2 as a whole is slow.
    ranks = ranks_at(where, [100, 30, 20, 22])
    assert node_medians(ranks) == {"h1": 65, "h2": 21}
    failures = evaluate(ranks, [], cfg)
    assert [(f.node, f.rank) for f in failures] == [("h2", None)]  # 21 / median node 43 = 49% < 60%
    assert "of the nodes' median 43" in failures[0].reason and "health.min_relative_fraction=0.6" in failures[0].reason
    report = HealthReport(ranks, [], failures, nodes=2, notes=observations(ranks, cfg))
    msg = report.failure_message()
    assert msg.startswith("pre-flight check failed on 1 of 2 node(s): node h2: matmul 21 TFLOP/s")
    assert "Exclude node(s) h2 from the job" in msg and "h1" not in msg and "health.preflight=off" in msg
    (note,) = report.notes
    assert note.startswith("rank 1 on h1 measured 30 TFLOP/s, 46% of its node's median 65; ranks that share a host")
    rows = [line for line in report.table().splitlines() if line.startswith("| h")]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["ok", "ok", "FAIL", "FAIL"]
    # Two hosts alike: one slow rank on each is noted, nothing fails.
    assert evaluate(ranks_at(where, [100, 20, 100, 20]), [], cfg) == []
    assert evaluate(ranks, [], HealthConfig(min_relative_fraction=0.4)) == []  # 49% passes a 40% bar


def test_one_node_reports_a_slow_rank_without_refusing_when_no_peak_is_configured() -> None:
    """The incident: two ranks of one busy host, one at 39% of the other; nothing else to compare with."""
    where = [("vm", 0), ("vm", 1)]
    ranks = ranks_at(where, [0.1, 0.039])
    cfg = HealthConfig()
    assert evaluate(ranks, [], cfg) == []
    report = HealthReport(ranks, [], [], nodes=1, notes=observations(ranks, cfg))
    assert report.passed and report.metrics()["preflight/notes"] == 1.0
    (note,) = report.notes
    assert note.startswith("rank 1 on vm measured 0.039 TFLOP/s, 56% of its node's median 0.0695")
    assert "reported, not judged (one node); cluster.peak_tflops sets one" in report.table()


def test_one_node_against_a_configured_peak_fails_with_advice_for_one_node() -> None:
    ranks = ranks_at([("vm", 0), ("vm", 1)], [0.1, 0.039], expected=1000)
    failures = evaluate(ranks, [], HealthConfig())
    assert [(f.node, f.rank) for f in failures] == [("vm", 0), ("vm", 1)]
    msg = HealthReport(ranks, [], failures, nodes=1).failure_message()
    assert msg.startswith(
        "pre-flight check failed on 1 of 1 node(s): node vm: rank 0: matmul 0.1 TFLOP/s is 0% of "
        "the expected 1e+03 (cluster.peak_tflops; health.min_matmul_fraction=0.5)"
    )
    assert "Exclude" not in msg and "no other node to move to: stop other work on this host" in msg
    assert "set cluster.peak_tflops to this device's real peak" in msg and "health.preflight=off" in msg
    broken = [dataclasses.replace(ranks[0], device_ok=False, device_note="matmul relative error 3e-01")]
    msg = HealthReport(broken, [], evaluate(broken, [], HealthConfig()), nodes=1).failure_message()
    assert "Repair the device or its driver" in msg


def test_a_peak_this_host_measured_earlier_is_noted_not_held_to() -> None:
    """A CPU's ``hlat bench peak`` was measured under whatever load the host had then: shown, never failed."""
    (measured,) = ranks_at([("vm", 0)], [0.01], expected=0.1)
    source = "measured float32 matmul peak (hlat bench peak)"
    ranks = [dataclasses.replace(measured, expected_source=source, expected_is_reference=False)]
    assert evaluate(ranks, [], HealthConfig()) == []
    (note,) = observations(ranks, HealthConfig())
    assert "10% of the measured float32 matmul peak (hlat bench peak) (0.1 TFLOP/s); not held to it" in note
    assert not reference_peak(to_run_config(compose_cfg()).cluster)  # cpu: only this host's measurement
    assert reference_peak(to_run_config(compose_cfg("cluster.peak_tflops=1")).cluster)
    assert reference_peak(to_run_config(compose_cfg("cluster=gpu")).cluster)  # a published figure by name


def test_the_expected_peak_is_an_absolute_bar() -> None:
    ranks = [rank(0, tflops=300, expected=989), rank(1, tflops=600, expected=989)]
    failures = evaluate(ranks, [], HealthConfig(min_matmul_fraction=0.5, min_relative_fraction=0))
    reasons = [(f.rank, f.reason.split(" (")[0]) for f in failures]
    assert reasons == [(0, "matmul 300 TFLOP/s is 30% of the expected 989")]
    assert evaluate(ranks, [], HealthConfig(min_matmul_fraction=0.3, min_relative_fraction=0)) == []


def test_device_errors_slow_nodes_the_world_and_tools_all_fail() -> None:
    cfg = HealthConfig(
        expected_busbw_gbps_intra=100,
        expected_busbw_gbps_world=50,
        min_bandwidth_fraction=0.5,
        min_relative_fraction=0.6,
    )
    w = figures(20)
    ranks = [
        rank(0, "a", intra=figures(120), world=w),
        rank(1, "a", intra=figures(110), world=w),
        rank(2, "b", intra=figures(40), world=w, ok=False, note="matmul relative error 3e-01"),
        rank(3, "b", intra=figures(45), world=w),
        rank(4, "c", intra=figures(115), world=w),
    ]
    tools = [ToolResult("c", "neuron-ls", False, "exit 1: failed to discover Neuron devices")]
    failures = [(f.node, f.rank, f.reason.split(" ")[0]) for f in evaluate(ranks, tools, cfg)]
    assert sorted(failures, key=str) == sorted(
        [
            ("b", 2, "device"),  # the wrong matmul
            ("b", None, "intra-node"),  # node b: 40 GB/s < 0.5 x 100 (absolute) ...
            ("b", None, "intra-node"),  # ... and < 0.6 x the nodes' median 110 (relative)
            ("c", None, "neuron-ls:"),
            (JOB, None, "world"),  # 20 GB/s < 0.5 x 50 over the world
        ],
        key=str,
    )
    reasons = [f.reason for f in evaluate(ranks, tools, cfg) if f.node == "b" and f.rank is None]
    assert "health.expected_busbw_gbps_intra=100" in reasons[0] and "of the nodes' median 110" in reasons[1]


def test_the_report_names_the_failing_nodes_in_the_table_the_message_and_the_metrics() -> None:
    ranks = [rank(0, "good", tflops=100, world=figures(10)), rank(1, "bad", tflops=10, world=figures(10))]
    report = HealthReport(ranks, [], evaluate(ranks, [], HealthConfig()), nodes=2)
    assert not report.passed
    msg = report.failure_message()
    assert msg.startswith(
        "pre-flight check failed on 1 of 2 node(s): node bad: matmul 10 TFLOP/s (the median of its "
        "ranks) is 18% of the nodes' median 55"
    )
    assert "Exclude node(s) bad from the job" in msg and "health.preflight=off" in msg and "good" not in msg
    rows = [line for line in report.table().splitlines() if line.startswith("| good") or line.startswith("| bad")]
    assert rows[0].endswith("| ok |") and rows[1].endswith("| FAIL |")
    assert "all-reduce GB/s (world)" in report.table()  # several nodes: world columns beside the node's
    m = report.metrics()
    assert (m["preflight/passed"], m["preflight/slowest_rank"], m["preflight/matmul_tflops_min"]) == (0.0, 1.0, 10)
    assert m["preflight/world_allreduce_busbw_gbps"] == 10 and "preflight/intra_allreduce_busbw_gbps" not in m


def test_straggler_metrics_name_the_rank_with_the_longest_local_time() -> None:
    # (step_s, local_s, data_wait_s): step times are equal (synchronous DP); rank 2 computes slowest.
    rows = [(1.0, 0.50, 0.0), (1.0, 0.52, 0.0), (1.0, 0.80, 0.3), (1.0, 0.48, 0.0)]
    m = straggler_metrics(rows)
    assert m["health/slowest_rank"] == 2.0
    assert m["health/straggler_lag_s"] == pytest.approx(0.80 - 0.51)  # median of 0.48, 0.50, 0.52, 0.80
    assert m["health/straggler_ratio"] == pytest.approx(0.80 / 0.51)
    assert straggler_metrics([(1.0, 0.0, 0.0), (1.0, 0.0, 0.0)])["health/straggler_ratio"] == 1.0


# --- measurements -----------------------------------------------------------------------------------------------------


def test_the_device_check_accepts_a_correct_matmul_and_rejects_a_wrong_one(monkeypatch) -> None:
    sync = checks.device_sync(torch.device("cpu"))
    assert checks.check_device(torch.device("cpu"), sync)[0]
    real = torch.Tensor.__matmul__
    # A device off by 10%: the fp32 matmul on the "device"; the float64 reference stays right.
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: real(a, b) * (1.1 if a.dtype == torch.float32 else 1))
    ok, note = checks.check_device(torch.device("cpu"), sync)
    assert not ok and note.startswith("matmul relative error 1.0e-01")


def test_a_device_without_synchronization_cannot_be_timed() -> None:
    with pytest.raises(ConfigError, match=r"cannot time work on a meta device.*health.preflight=off"):
        checks.device_sync(torch.device("meta"))
    marker = []
    checks.device_sync(torch.device("meta"), lambda: marker.append(1))()
    assert marker == [1]


def test_the_throttle_sleeps_after_each_matmul_only(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(checks.time, "sleep", slept.append)
    a = torch.randn(64, 64)
    with checks.Throttle(0.25, lambda: None):
        torch.matmul(a, a)
        torch.add(a, a)
        torch.matmul(a, a)
    assert len(slept) == 2 and all(s >= 0 for s in slept)  # 3x each matmul's duration: 1/0.25 - 1


def test_collective_figures_follow_the_nccl_tests_formulas(monkeypatch) -> None:
    times = iter([0.01, 0.02, 1e-5])  # all-reduce, all-gather, latency: seconds per call
    monkeypatch.setattr(checks, "time_collective", lambda *a, **k: next(times))
    f = checks.collective_figures(torch.device("cpu"), lambda: None, nbytes=2**20, iters=1, size=4)
    assert f["allreduce_busbw_gbps"] == pytest.approx(2**20 / 0.01 * 2 * 3 / 4 / 1e9)
    assert f["allgather_busbw_gbps"] == pytest.approx(2**20 / 0.02 * 3 / 4 / 1e9)
    assert f["latency_us"] == pytest.approx(10.0)


# --- Neuron tools -----------------------------------------------------------------------------------------------------


def test_the_documented_tool_outputs_parse() -> None:
    rows, avg, errors = parse_nccom_test(NCCOM_OK)
    assert (
        rows
        == [
            {
                "size_bytes": 33554432.0,
                "count": 33554432.0,
                "time_us": 768.0,
                "algbw_gibps": 40.69,
                "busbw_gibps": 40.69,
            }
        ]
        and avg == 40.6901
        and errors == []
    )
    rows, avg, errors = parse_nccom_test(NCCOM_FAILED)
    assert rows == [] and avg is None and len(errors) == 2
    (device,) = parse_neuron_ls(NEURON_LS)
    assert device["nc_count"] == 2
    with pytest.raises(ValueError, match="nc_count"):
        parse_neuron_ls('{"not": "a list"}')


def fake_tool(bin_dir: Path, name: str, stdout: str, code: int = 0, stderr: str = "") -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f"#!/bin/sh\necho \"$@\" > {bin_dir / (name + '.args')}\ncat <<'EOF'\n{stdout}\nEOF\n"
        f"echo '{stderr}' >&2\nexit {code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_the_tools_run_when_installed_and_fail_the_node_when_they_fail(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # the fakes, and sh's cat
    assert neuron_ls("n1", 2) is None and nccom_test("n1", "allr", 2, 1024) is None  # not installed: skipped
    fake_tool(tmp_path / "bin", "neuron-ls", NEURON_LS)
    fake_tool(tmp_path / "bin", "nccom-test", NCCOM_OK)
    ls = neuron_ls("n1", 2)
    assert ls.ok and ls.figures == {"neuron_devices": 1, "neuroncores": 2} and "2 NeuronCore(s), 32 GiB" in ls.summary
    assert not neuron_ls("n1", 32).ok  # 32 processes, 2 NeuronCores
    allr = nccom_test("n1", "allr", 2, 33554432, min_gbps=40.0)
    assert (tmp_path / "bin" / "nccom-test.args").read_text().split() == [
        "-r",
        "2",
        "-b",
        "33554432",
        "-e",
        "33554432",
        "-d",
        "fp32",
        "allr",
    ]
    assert allr.ok and allr.figures["busbw_gbps"] == pytest.approx(40.6901 * 2**30 / 1e9)
    assert not nccom_test("n1", "allr", 2, 33554432, min_gbps=50.0).ok  # 43.7 GB/s < 50
    fake_tool(tmp_path / "bin", "nccom-test", NCCOM_FAILED, code=1)
    failed = nccom_test("n1", "allg", 2, 1024)
    assert not failed.ok and "Failure running neuron-bench" in failed.summary
    fake_tool(tmp_path / "bin", "neuron-ls", "", code=1, stderr='level=fatal msg="failed to discover Neuron devices"')
    assert not neuron_ls("n1", 2).ok


# --- the watchdog -----------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Step:
    step: int


def test_the_threshold_is_the_allowance_then_factor_times_the_median_with_a_floor(tmp_path: Path) -> None:
    clock, exits = FakeClock(), []
    # Small durations: the grace before the exit (2 x the median step) is waited in real time.
    cfg = HealthConfig(watchdog_factor=10, watchdog_floor_s=0.05, watchdog_first_step_s=100, watchdog_grace_s=0)
    wd = HangWatchdog(cfg, tmp_path / "hang", rank=3, last_step=100, exit_fn=exits.append, clock=clock)
    assert wd.threshold() == 100  # no step yet: start-up and compilation
    clock.now += 60  # a slow first step (compilation) is not a hang ...
    assert not wd.check()
    wd(Step(1))
    assert wd.threshold() == 100  # ... and is not a typical step: the second one still gets the allowance
    for s in range(2, 6):
        clock.now += 0.002
        wd(Step(s))
    assert wd.median() == pytest.approx(0.002) and wd.threshold() == 0.05  # 10 x 2 ms is below the 50 ms floor
    for s in range(6, 16):
        clock.now += 0.01
        wd(Step(s))
    assert wd.threshold() == pytest.approx(0.1)  # the median moved to 10 ms: 10 x 10 ms
    clock.now += 0.099
    assert not wd.check() and exits == []
    clock.now += 0.002
    assert wd.check() and exits == [HANG_EXIT_CODE]
    dump = (tmp_path / "hang" / "rank3.txt").read_text()
    assert "rank 3" in dump and "step 16 has run 0.1s" in dump and "median step 0.010s" in dump
    assert "faulthandler (all threads)" in dump and "test_health.py" in dump  # this very test's frame


def test_the_watchdog_stands_down_after_the_last_step(tmp_path: Path) -> None:
    clock, exits = FakeClock(), []
    wd = HangWatchdog(
        HealthConfig(watchdog_first_step_s=1, watchdog_floor_s=1),
        tmp_path,
        0,
        last_step=2,
        exit_fn=exits.append,
        clock=clock,
    ).start()
    wd(Step(1))
    wd(Step(2))  # the last step: the final save, plots and evaluations are not steps
    assert wd._thread is not None and not wd._thread.is_alive()
    clock.now += 1e6
    assert not wd.check() and exits == [] and not list(tmp_path.iterdir())


def test_the_thread_fires_on_its_own_when_no_step_ends(tmp_path: Path) -> None:
    fired = threading.Event()
    codes: list[int] = []
    cfg = HealthConfig(watchdog_first_step_s=0.3, watchdog_grace_s=0)
    wd = HangWatchdog(cfg, tmp_path, 0, last_step=10, exit_fn=lambda c: (codes.append(c), fired.set())).start()
    try:
        assert fired.wait(hang_guard(120)), "the watchdog thread never fired"
    finally:
        wd.close()
    assert codes == [HANG_EXIT_CODE]
    assert "test_the_thread_fires_on_its_own" in (tmp_path / "rank0.txt").read_text()  # the waiting main thread


def test_py_spy_is_called_on_this_process_when_installed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # the fakes, and sh's cat
    assert "not installed" in py_spy_dump(os.getpid())
    fake_tool(tmp_path / "bin", "py-spy", "Thread 1 (idle): MainThread")
    out = py_spy_dump(4242)
    assert "Thread 1 (idle): MainThread" in out and "exit 0" in out
    assert (tmp_path / "bin" / "py-spy.args").read_text().split() == ["dump", "--pid", "4242"]


# --- configuration ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("health.preflight=sometimes", "health.preflight"),
        ("health.min_relative_fraction=1.5", "min_relative_fraction"),
        ("health.watchdog_factor=1", "health.watchdog_factor"),
        ("health.straggler_every=-1", "health.straggler_every"),
        ("health.collective_timeout_s=0", "health.collective_timeout_s"),
        ("health.inject_slow_factor=0", "inject_slow"),
    ],
)
def test_bad_health_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        to_run_config(compose_cfg(override))


def test_presets_and_auto_mode() -> None:
    default = to_run_config(compose_cfg()).health
    assert default.preflight == "auto" and not default.preflight_enabled(1) and default.preflight_enabled(2)
    off = to_run_config(compose_cfg("health=off")).health
    assert (off.name, off.preflight, off.watchdog, off.straggler_every) == ("off", "off", False, 0)
    assert not off.preflight_enabled(64)
    assert to_run_config(compose_cfg("health.preflight=on")).health.preflight_enabled(1)


def test_the_hang_fault_validates_its_rank_and_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fault\.hang_at=0 must be >= 1 or null"):
        FaultConfig(hang_at=0)
    assert FaultConfig(hang_at=3).active
    with pytest.raises(ConfigError, match=r"fault.hang_rank=1 is not a rank of this 1-rank job"):
        FaultInjector(FaultConfig(hang_at=3, hang_rank=1), steps=10, markers=tmp_path)
    cfg = to_run_config(compose_cfg("fault=hang")).fault
    assert (cfg.hang_at, cfg.hang_rank) == (100, 1)
    cfg = to_run_config(compose_cfg("fault=sigstop")).fault
    assert (cfg.sigstop_at, cfg.hang_at, cfg.hang_rank, cfg.active) == (100, None, 1, True)
    with pytest.raises(ConfigError, match=r"fault\.sigstop_at=0 must be >= 1 or null"):
        FaultConfig(sigstop_at=0)


# --- the trainer's side -----------------------------------------------------------------------------------------------


def test_auto_skips_a_device_it_cannot_time_and_on_refuses_it(caplog) -> None:
    from hlat.backends.base import Env
    from hlat.health.preflight import preflight

    env = Env(rank=0, world_size=2, device=torch.device("meta"), memory_budget_bytes=0)
    auto = to_run_config(compose_cfg("cluster=cpu_x2"))
    assert preflight(auto, env) is None and "no pre-flight check: timing work on a meta device" in caplog.text
    with pytest.raises(ConfigError, match=r"Backend\.synchronize"):
        preflight(to_run_config(compose_cfg("cluster=cpu_x2", "health.preflight=on")), env)
    with pytest.raises(ConfigError, match=r"health.inject_slow_rank=5 is not a rank of this 2-rank job"):
        preflight(to_run_config(compose_cfg("cluster=cpu_x2", "health.inject_slow_rank=5")), env, sync=lambda: None)
    assert preflight(to_run_config(compose_cfg()), dataclasses.replace(env, world_size=1)) is None  # auto, 1 rank


def test_a_failed_preflight_is_final_and_a_hang_is_named_when_restarts_run_out(tmp_path: Path) -> None:
    from hlat.health.report import PreflightError
    from hlat.train import entry
    from hlat.train.entry import error_message

    assert issubclass(PreflightError, ConfigError)  # final like a configuration error (never retried) ...
    assert error_message(PreflightError("node vm: ...")) == "hlat: health check failed: node vm: ..."  # ... not one
    assert PreflightError("x").exit_code == 3 and not hasattr(ConfigError("x"), "exit_code")  # python train.py: 3
    # The agent maps a worker's final error back by its class name: a PreflightError must not be retried.
    assert next(t for t in entry.FINAL_ERRORS if t.__name__ == "PreflightError") is PreflightError
    assert entry._exit_text(HANG_EXIT_CODE, tmp_path) == (
        f"exit code 75 (a hang; the watchdog's report and stack dumps are in {tmp_path / 'hang'})"  # no report yet
    )
    assert entry._exit_text(1, tmp_path) == "exit code 1"


def test_hlat_doctor_is_a_subcommand_and_checks_one_process(capsys, tmp_path: Path, monkeypatch) -> None:
    """`hlat doctor` with one process (cluster=cpu): the table of rank 0 and a pass, in a report file; no MLflow
    without --mlflow (the default tracker is mlflow: no mlflow.db appears)."""
    from hlat.cli import main as hlat_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        hlat_main(
            [
                "doctor",
                "health.matmul_size=128",
                "health.matmul_seconds=0.05",
                "health.matmul_repeats=1",
                "health.min_matmul_fraction=0",
            ]
        )  # no peak to hold it to
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    row = next(line for line in out.splitlines() if line.startswith("| ") and "| 0 |" in line)
    assert row.rstrip().endswith("ok |") and "cpu ok" in row
    assert "hlat doctor: all 1 rank(s) on 1 node(s) passed" in out
    (report,) = (tmp_path / "outputs" / "doctor").glob("*-cpu.md")
    assert f"hlat doctor: report written to {report.relative_to(tmp_path)}" in out
    assert row in report.read_text() and report.read_text().startswith("# pre-flight check: passed")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
