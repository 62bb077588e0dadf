"""Shared fixtures: compose the real conf/ tree with Hydra's compose API."""

from __future__ import annotations

import importlib.util
import os

# One intra-op thread per test process, and for every process a test starts (they inherit the variable): with two
# threads on a 2-core machine that has any other work, torch's OpenMP threads wait for each other at every op, and a
# tiny model's step takes ~100x longer (a 64-wide linear layer: 0.4 ms with one thread, 40 ms with two beside one busy
# process). The suite's models are tiny: one thread is as fast on a quiet machine and immune to a busy one. Set
# OMP_NUM_THREADS to override. The NxD lane (torch-xla installed: make test-neuron) is left as it was.
if importlib.util.find_spec("torch_xla") is None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every test names its MLflow store or uses the default in its own directory: a developer's MLFLOW_TRACKING_URI (a
# team server) must not receive the suite's runs, nor change which store a test reads (hlat honours the variable).
os.environ.pop("MLFLOW_TRACKING_URI", None)

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from hlat.config import OptimizerConfig, RunConfig, TrainConfig, register_configs, to_run_config
from tests.timeouts import hang_guard

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()
if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where torch was imported before this file


def compose_cfg(*overrides: str) -> DictConfig:
    """Compose conf/config.yaml with ``overrides``, exactly as ``python train.py`` would."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_config(*overrides: str) -> RunConfig:
    """The typed, validated config ``python train.py`` would train with those overrides (what ``run.main`` takes)."""
    return to_run_config(compose_cfg(*overrides))


def backend_config(*, seed: int = 0, **groups: Any) -> RunConfig:
    """The run config of a backend built by hand: the schema's defaults with ``groups`` (``cluster=``, ``precision=``,
    ``parallelism=``, ``optimizer=``, ``model=`` ...) and ``train.seed``; no warm-up unless ``optimizer`` says
    otherwise. A small ``model`` gets its ``max_seq_len`` as ``train.seq_len`` (the tests feed their own batches)."""
    train = TrainConfig(seed=seed, seq_len=groups["model"].max_seq_len) if "model" in groups else TrainConfig(seed=seed)
    return RunConfig(**{"train": train, "optimizer": OptimizerConfig(warmup_steps=0), **groups})


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Every test starts with torch's thread count as the session began: tests that pin one thread (multi-process
    parity) must not change the numerics of later in-process runs compared with subprocess ones. On some CPUs one
    and two threads give different bits, which broke a bitwise-recovery oracle computed in-process."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data cache (builtin corpus, trained tokenizers) shared by the whole session."""
    return tmp_path_factory.mktemp("hlat-cache")


@contextmanager
def lock_held_elsewhere(root: Path) -> Iterator[None]:
    """Another live process holds ``root``'s trainer lock (``hlat.checkpoint.hold_lock``) inside the block."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from pathlib import Path; from hlat.checkpoint import hold_lock; "
                f"f = hold_lock(Path({str(root)!r})); print('held', flush=True); time.sleep({hang_guard(3600)})"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


# Modules whose tests share a costly module fixture: one worker runs them all, so the fixture is made once.
SHARED_FIXTURE_MODULES = {
    "tests/integration/test_mlflow_ui.py": "one sweep, mlflow server and browser",
    "tests/integration/test_train.py": "one 80-step run (short_run)",
}


def xdist_group(nodeid: str) -> str:
    """The unit of work that one pytest-xdist worker runs, in order: a README lane command's doc file (its commands
    build on each other), a module of :data:`SHARED_FIXTURE_MODULES`, else the test alone."""
    path, _, test = nodeid.partition("::")
    if path == "tests/readme/test_readme.py":
        return test.rsplit("[", 1)[-1].split(":", 1)[0]  # test_readme_command[docs/data.md:6] -> docs/data.md
    return path if path in SHARED_FIXTURE_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (make test, test-slow, test-readme) by :func:`xdist_group`. pytest-xdist 3.8 would read
    ``xdist_group`` marks, but the node-id tag it sets for them has no effect on pytest 9, so the groups are named by
    node id here, where the scheduler (which sees node ids only) can read them."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return ByGroup(config, log)
