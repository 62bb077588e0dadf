"""Fixtures of the image lane: the Dockerfile's images built with podman, and host volumes for what they write.

The images are built (or found in podman's layer cache) once per session by ``tests/image/build.sh``. These tests
need root, podman and minutes of building, so the main suite leaves them out: they are collected only with
``HLAT_IMAGE_LANE=1`` (``make test-image``) or when named on the command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.timeouts import hang_guard

if os.environ.get("HLAT_IMAGE_LANE") != "1":
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONF = HERE / "containers.conf"
USER = 1000
"""The cpu image's user (the Dockerfile's ``USER 1000:1000``): host folders it writes must be its own."""
TINY = (
    "model.n_layers=1",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "optimizer.warmup_steps=1",
    "train.log_every=1",
    "tracker.flush_every_s=0",
    "tracker.plots=false",
    "tracker.system_metrics=false",
    "health=off",
    "cluster.num_threads=1",
)
"""A few seconds of training: the tiny model, small batches, no health checks or plots, one thread (as the main
suite's OMP_NUM_THREADS=1: the machine's cores are shared with other lanes)."""
STORE = "tracker.uri=sqlite:////opt/hlat/mlruns/mlflow.db"
"""The MLflow store on the ``mlruns`` volume, beside the artifacts (MLflow's default ./mlruns in /opt/hlat)."""


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONF)}


def podman(*args: str, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with the lane's containers.conf; its output as text."""
    done = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=hang_guard(timeout)
    )
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr[-4000:]}"
    return done


def _cannot_run(why: str) -> None:
    """Skip where the lane was not asked for; in the lane a missing prerequisite fails (a lane that skips
    everything would pass while testing nothing)."""
    if os.environ.get("HLAT_IMAGE_LANE") == "1":
        pytest.fail(f"the image lane cannot run here: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """``cpu`` and ``trn1``: the images ``tests/image/build.sh`` built (or found unchanged), by target."""
    if os.geteuid() != 0:
        _cannot_run("the image lane builds with rootful podman: run it as root")
    if shutil.which("podman") is None:
        _cannot_run("podman is not installed (tests/image/install.sh installs it)")
    t0 = time.monotonic()
    build = ["bash", str(HERE / "build.sh"), "all"]
    done = subprocess.run(build, env=podman_env(), capture_output=True, text=True, timeout=hang_guard(3600))
    assert done.returncode == 0, done.stderr[-6000:]
    print(f"\nimages built or found in {time.monotonic() - t0:.0f} s")
    return {"cpu": "hlat:cpu", "trn1": "hlat:trn1"}


@pytest.fixture
def volumes(tmp_path: Path) -> Path:
    """``outputs/`` and ``mlruns/`` (the MLflow store and artifacts) for the cpu image, owned by its user."""
    for name in ("outputs", "mlruns"):
        (tmp_path / name).mkdir()
        os.chown(tmp_path / name, USER, USER)
    return tmp_path


def mounts(root: Path) -> list[str]:
    """``-v`` flags for ``volumes``: outputs and MLflow, as docs/container.md mounts them."""
    return ["-v", f"{root / 'outputs'}:/opt/hlat/outputs", "-v", f"{root / 'mlruns'}:/opt/hlat/mlruns"]


@pytest.fixture
def container_names() -> Iterator[list[str]]:
    """Names of containers a test starts; each is removed after the test, whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        podman("rm", "--force", "--time", "0", name, timeout=120)
