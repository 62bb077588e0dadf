"""Which torch ``make install`` asks pip for (``scripts/torch_pip_args.py``): PyTorch's CPU index on a Linux host
without an NVIDIA GPU when that index answers, pip's own index otherwise, and ``TORCH_PIP_ARGS`` over both.

The index is a loopback HTTP server standing in for download.pytorch.org (nothing is downloaded); the GPU is a fake
``nvidia-smi`` on PATH. A host with a real NVIDIA driver cannot show the no-GPU cases: skipped there.
"""

from __future__ import annotations

import http.server
import os
import platform
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "torch_pip_args.py"

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or Path("/proc/driver/nvidia/version").exists(),
    reason="the CPU-index choice is Linux's, and this host has an NVIDIA driver",
)


@pytest.fixture(scope="module")
def index() -> Iterator[str]:
    """A loopback server that answers every request (404: an answer all the same)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()
    server.server_close()


def _choose(url: str, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "LANG": "C.UTF-8"}  # no nvidia-smi unless bin_dir has one; no proxy variables
    return subprocess.run(
        [sys.executable, str(SCRIPT), url], env=env, capture_output=True, text=True, timeout=60, check=True
    )


def test_cpu_index_without_a_gpu_else_pips_own(index: str, tmp_path: Path) -> None:
    done = _choose(index, tmp_path)
    assert done.stdout.strip() == f"--index-url {index}" and "no NVIDIA GPU here" in done.stderr
    with socket.socket() as s:  # a port nothing listens on: the index does not answer (a mirror that serves only PyPI)
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"
    done = _choose(dead, tmp_path)
    assert done.stdout.strip() == "" and f"{dead} does not answer" in done.stderr
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    done = _choose(index, tmp_path)
    assert done.stdout.strip() == "" and "an NVIDIA GPU is here" in done.stderr


def test_the_makefile_uses_the_choice_unless_told(index: str, tmp_path: Path) -> None:
    """What ``make install`` would run (``make -n``): the chosen index, or ``TORCH_PIP_ARGS`` as given."""

    def torch_line(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TORCH_PIP_ARGS"}
        out = subprocess.run(
            ["make", "-n", "-B", f"{tmp_path}/venv/.installed", f"VENV={tmp_path}/venv", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return next(line for line in out.splitlines() if line.endswith(" torch"))

    assert f"pip install -q --index-url {index} -c constraints.txt torch" in torch_line(f"TORCH_CPU_INDEX={index}")
    assert "pip install -q  -c constraints.txt torch" in torch_line(f"TORCH_CPU_INDEX={index}", "TORCH_PIP_ARGS=")
    assert "pip install -q --pre -c" in torch_line(f"TORCH_CPU_INDEX={index}", "TORCH_PIP_ARGS=--pre")
