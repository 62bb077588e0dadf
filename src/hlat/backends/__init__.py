"""Backends: the one place where the platform is chosen.

Owns ``base`` (the ``Backend`` protocol and its ``Env``), the ``torch`` package (plain PyTorch: CPU, CUDA,
DDP / ZeRO-1, tensor parallelism, and the mechanisms only it applies to the model: precision, emulated bf16
matmuls, activation checkpointing) and ``neuron*`` (torch-neuronx + NeuronX Distributed; the only modules that
import them, and only inside functions). May import: ``hlat.config``, the core modules, ``hlat.launch`` (the restart
attempt) and ``hlat.plan``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hlat.backends.base import Backend, Env
from hlat.config import ConfigError

if TYPE_CHECKING:
    from hlat.config import RunConfig

__all__ = ["Backend", "Env", "get_backend"]


def get_backend(cfg: RunConfig) -> Backend:
    """Return the backend that ``cluster.backend`` names, for the run ``cfg``, imported lazily.

    ``torch`` (CPU/CUDA) or ``neuron`` (trn1; torch_xla and NxD are imported by its ``setup``). The backend keeps
    ``cfg``: its methods read what they need of it (the environment, precision, parallelism, optimizer).
    """
    name = cfg.cluster.backend
    if name == "torch":
        from hlat.backends.torch.backend import TorchBackend

        return TorchBackend(cfg)
    if name == "neuron":
        from hlat.backends.neuron import NeuronBackend

        return NeuronBackend(cfg)
    raise ConfigError(f"cluster.backend={name!r} is not one of torch, neuron")
