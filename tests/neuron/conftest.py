"""The NxD lane: tests against the real NeuronX Distributed 0.17 on torch-xla's CPU device.

They run only in the lane's environment (``make test-neuron`` builds ``.venv-neuron``, where ``neuron_stub`` is
installed at interpreter start); in the main environment, which has no torch-xla, they are skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("torch_xla") is not None and importlib.util.find_spec("neuronx_distributed"):
        return
    skip = pytest.mark.skip(reason="needs the NxD lane's environment: make test-neuron (torch-xla 2.9 + NxD 0.17)")
    for item in items:
        if "tests/neuron/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data cache for the lane (the builtin corpus tokenized once)."""
    return tmp_path_factory.mktemp("hlat-cache")
