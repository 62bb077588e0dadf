"""Shared fixtures: compose the real conf/ tree with Hydra's compose API."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from hlat.config import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def compose_cfg(*overrides: str) -> DictConfig:
    """Compose conf/config.yaml with ``overrides``, exactly as ``python train.py`` would."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


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
    """Another live process holds ``root``'s trainer lock (``hlat.train.checkpoint.hold_lock``) inside the block."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from hlat.train.checkpoint import hold_lock; "
        f"f = hold_lock(Path({str(root)!r})); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()
