"""Fault injection: seeded kill steps, once-per-job markers, the save faults, NaN gradients, SIGSTOP."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from hlat.config import ConfigError, FaultConfig
from hlat.state import TrainState
from hlat.train.faults import FaultInjector, kill_steps
from tests.timeouts import hang_guard


def test_kill_steps_are_seeded_distinct_and_inside_the_run() -> None:
    cfg = FaultConfig(kill_at=[5], kill_random=3, seed=7)
    steps = kill_steps(cfg, 40)
    assert steps == kill_steps(cfg, 40) and len(steps) == 4 and 5 in steps
    assert all(1 <= s < 40 for s in steps)
    assert kill_steps(FaultConfig(kill_random=3, seed=8), 40) != kill_steps(FaultConfig(kill_random=3, seed=7), 40)
    assert kill_steps(FaultConfig(kill_random=10), 4) == [1, 2, 3]  # no more kills than steps


def test_bad_fault_steps_are_config_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"^fault\.kill_at=\[0, 3\] holds a step below 1: .* e\.g\. fault\.kill_at=\[3\]$"
    ):
        FaultConfig(kill_at=[0, 3])
    assert not FaultConfig().active and FaultConfig(corrupt_at=3).active


def test_disk_full_fires_once_and_leaves_a_short_file(tmp_path: Path) -> None:
    inj = FaultInjector(FaultConfig(disk_full_at=4), steps=10, markers=tmp_path / "faults")
    d = tmp_path / "step_00000004.tmp"
    d.mkdir()
    (d / "weights").write_bytes(b"x" * 100)
    inj.on_save("written", 3, d)  # another step: nothing
    with pytest.raises(OSError) as e:
        inj.on_save("written", 4, d)
    assert e.value.errno == errno.ENOSPC and (d / "weights").stat().st_size == 50
    inj.on_save("written", 4, d)  # the restarted job saves step 4 again: the fault does not repeat
    again = FaultInjector(FaultConfig(disk_full_at=4), steps=10, markers=tmp_path / "faults")
    again.on_save("written", 4, d)  # nor in a new process of the same job


def test_nan_gradients_at_the_chosen_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    inj = FaultInjector(FaultConfig(nonfinite_at=[2]), steps=10, markers=tmp_path)
    inj.poison_grads(1, model)
    assert torch.isfinite(model.weight.grad).all()
    inj.poison_grads(2, model)
    assert torch.isnan(model.weight.grad).all()


def test_min_step_s_sleeps_what_the_step_left_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that took 0.3 s of a 1 s minimum sleeps 0.7 s; one that took longer sleeps nothing."""
    import hlat.train.faults as faults

    now, slept = [100.0], []
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(faults.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    inj = FaultInjector(FaultConfig(min_step_s=1.0), steps=10, markers=tmp_path / "faults")
    assert inj.cfg.active
    for step, took in enumerate([0.3, 2.5, 1.0], start=1):
        now[0] += took
        inj(TrainState(step=step), None)
    assert slept == pytest.approx([0.7, 0.0, 0.0])
    with pytest.raises(ConfigError, match=r"fault.min_step_s=-1.0 must be >= 0"):
        FaultConfig(min_step_s=-1.0)


def test_sigstop_freezes_the_chosen_rank_once_per_job(tmp_path: Path) -> None:
    """A real process runs the hook after steps 1-3 with ``sigstop_at=2``: the kernel reports it stopped after step 2,
    it goes on when continued, and a restarted job that replays step 2 is not stopped again (the marker)."""
    code = (
        "from pathlib import Path; from hlat.config import FaultConfig; from hlat.train.faults import FaultInjector\n"
        "class S: step = 0\n"
        f"inj = FaultInjector(FaultConfig(sigstop_at=2, hang_rank=0), steps=5, markers=Path({str(tmp_path)!r}))\n"
        "for s in (1, 2, 3):\n"
        "    S.step = s; print('before', s, flush=True); inj(S, None)\n"
        "print('done', flush=True)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["before 1", "before 2"]
        deadline = time.monotonic() + hang_guard(60)
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout.read().splitlines() == ["before 3", "done"]
        assert proc.wait(timeout=hang_guard(60)) == 0
    finally:
        proc.kill()
        proc.wait()
    again = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=hang_guard(120)
    )
    assert again.returncode == 0 and again.stdout.splitlines() == ["before 1", "before 2", "before 3", "done"]
    with pytest.raises(ConfigError, match=r"fault.hang_rank=1 is not a rank of this 1-rank job"):
        FaultInjector(FaultConfig(sigstop_at=3), steps=10, markers=tmp_path)
