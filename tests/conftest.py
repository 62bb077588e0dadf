"""Shared fixtures: compose the real conf/ tree with Hydra's compose API."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from hlat.config import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def compose_cfg(*overrides: str) -> DictConfig:
    """Compose conf/config.yaml with ``overrides``, exactly as ``python train.py`` would."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data cache (builtin corpus, trained tokenizers) shared by the whole session."""
    return tmp_path_factory.mktemp("hlat-cache")
