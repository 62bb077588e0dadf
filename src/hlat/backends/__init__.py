"""Backends: the one place where the platform is chosen.

Owns ``base`` (the ``Backend`` protocol and its ``Env``), ``torch`` / ``torch_dist`` (plain PyTorch: CPU, CUDA,
DDP / ZeRO-1, tensor parallelism) and ``neuron*`` (torch-neuronx + NeuronX Distributed; the only modules that
import them, and only inside functions). May import: ``hlat.config``, the core modules and ``hlat.plan``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hlat.backends.base import Backend, Env
from hlat.config import ConfigError

if TYPE_CHECKING:
    from hlat.config import RunConfig

__all__ = ["Backend", "Env", "get_backend"]


def get_backend(name: str, cfg: RunConfig | None = None) -> Backend:
    """Return the backend named by ``cluster.backend``, imported lazily.

    Args:
        name: ``torch`` (CPU/CUDA) or ``neuron`` (trn1; torch_xla and NxD are imported by its ``setup``).
        cfg: The run config; the neuron backend needs it (its environment and NxD config depend on several groups),
            the torch backend reads ``train.compile`` and ``health.collective_timeout_s`` from it.
    """
    if name == "torch":
        from hlat.backends.torch import TorchBackend

        return TorchBackend(cfg)
    if name == "neuron":
        from hlat.backends.neuron import build_backend

        return build_backend(cfg)
    raise ConfigError(f"cluster.backend={name!r} is not one of torch, neuron")
