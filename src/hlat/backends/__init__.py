"""Backends: the one place where the platform is chosen."""

from __future__ import annotations

from hlat.backends.base import Backend, Env
from hlat.config import ConfigError

__all__ = ["Backend", "Env", "get_backend"]


def get_backend(name: str) -> Backend:
    """Return the backend named by ``cluster.backend`` (imported lazily: neuron needs torch-neuronx)."""
    if name == "torch":
        from hlat.backends.torch import TorchBackend

        return TorchBackend()
    raise ConfigError(
        f"cluster.backend={name!r} is not available in this version; use cluster=cpu (backend: torch). "
        "The neuron backend for trn1 arrives with the Trainium issue."
    )
