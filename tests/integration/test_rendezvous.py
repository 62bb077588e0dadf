"""A supervised one-node run listens on loopback only: torch elastic's stores and the ranks' gloo sockets.

The oracle is the kernel's view of the process tree: every listening TCP socket of the agent and of its trainers,
sampled while the job runs (through a SIGKILL and the restart), is bound to 127.0.0.1 or ::1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.test_train import ROOT, SMALL_RUN
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
LOOPBACK = {"127.0.0.1", "::1"}


def listening_sockets(root: psutil.Process) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` of every listening TCP socket of ``root`` and its descendants (gone ones skipped)."""
    found = set()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for p in procs:
        try:
            found |= {
                (p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN
            }
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_a_supervised_one_node_run_listens_on_loopback_only(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        *SMALL_RUN,
        "cluster=cpu_x2",
        "cluster.max_restarts=1",
        "health=off",
        "tracker=console",
        "train.steps=12",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.log_every=2",
        "train.checkpoint_every=4",
        "optimizer.warmup_steps=2",
        "fault.kill_at=[6]",
        "tracker.plots=false",
        f"data.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the launcher's own choice, not the caller's
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    agent, seen = psutil.Process(proc.pid), set()
    deadline = time.monotonic() + hang_guard(1500)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listening_sockets(agent)
            time.sleep(0.05)
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-5000:]
    assert "restart 1 of this job" in out + (run_dir / "train.log").read_text()
    pids = {pid for pid, _, _ in seen}
    assert proc.pid in pids and len(pids) >= 3, seen  # the agent's stores, and trainers' gloo listeners (2 or more)
    exposed = {(pid, ip, port) for pid, ip, port in seen if ip not in LOOPBACK}
    assert not exposed, f"listening beyond loopback: {sorted(exposed)} (all: {sorted(seen)})"
