"""The ``init_method`` of NxD's parallel layers, keyed by ``hlat.model``'s parameter names, for ``neuron_model``.

Each draws the whole (unsharded) weight with ``hlat.model.init_normal``; NxD keeps this rank's shard. Imports nothing
of torch_xla or NxD.
"""

from __future__ import annotations

import torch
from torch import nn

from hlat.config import ModelConfig
from hlat.model import init_normal


class NamedInit:
    """An NxD ``init_method`` keyed by name: fills the full (unsharded) weight with ``hlat.model.init_normal``.

    NxD keeps this rank's shard of it (``_initialize_parameter_cpu``), so weight ``name`` gets the torch backend's
    values whatever the tensor-parallel degree, the pipeline stage or the order NxD initializes modules in.
    """

    def __init__(self, seed: int, name: str, std: float) -> None:
        self.seed, self.name, self.std = seed, name, std

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return weight.copy_(init_normal(self.seed, self.name, weight.shape, self.std))

    def __repr__(self) -> str:
        return f"NamedInit({self.name!r}, std={self.std:g})"


class QKVInit:
    """The ``init_method`` of ``GQAQKVColumnParallelLinear``: q, k and v cut from hlat's fused qkv weight.

    The layer calls it three times per initialization, on the whole q, k and v weights in that order
    (``initialize_weight_biases``); the values come from the torch model's group-interleaved ``qkv.weight`` (rows
    ``[q_0 .. q_{r-1}, k, v]`` per kv group, ``hlat.model``), drawn once by name, so query head h keeps kv head h // r.
    """

    def __init__(self, seed: int, name: str, std: float, cfg: ModelConfig) -> None:
        self.seed, self.name, self.std, self.cfg = seed, name, std, cfg
        self._calls = 0

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The full q (H*D, dim), k and v (G*D, dim) weights of the torch model's fused projection."""
        c, D = self.cfg, self.cfg.head_dim
        r = c.n_heads // c.kv_heads
        full = init_normal(self.seed, self.name, ((c.n_heads + 2 * c.kv_heads) * D, c.dim), self.std)
        groups = full.view(c.kv_heads, r + 2, D, c.dim)
        q = groups[:, :r].reshape(c.n_heads * D, c.dim)
        return q, groups[:, r].reshape(-1, c.dim), groups[:, r + 1].reshape(-1, c.dim)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        part = self.parts()[self._calls % 3]
        self._calls += 1
        if tuple(weight.shape) != tuple(part.shape):
            raise AssertionError(
                f"{self.name}: NxD asked for a {tuple(weight.shape)} weight, q/k/v part is {tuple(part.shape)}"
            )
        with torch.no_grad():
            return weight.copy_(part)

    def __repr__(self) -> str:
        return f"QKVInit({self.name!r}, std={self.std:g})"


TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions", "rank_ordering")
"""What NxD's ``set_tensor_model_parallel_attributes`` sets on a sharded parameter."""


def mark_fused_qkv(layer: nn.Module) -> None:
    """Give ``GQAQKVColumnParallelLinear``'s fused ``weight_qkv`` the tensor-parallel attributes it lost.

    NxD 0.17 rebuilds it as a new ``Parameter(torch.cat([q, k, v]))`` without them (``modules/qkv_linear.py:541``),
    so ``get_grad_norm`` took it for replicated and divided its share by tp: clipping and ``train/grad_norm`` were
    wrong with tp > 1. Each rank holds its own rows; replicated k and v rows (``kv_size_multiplier`` > 1) then count
    once per copy, as in NxD's unfused layer.
    """
    w = getattr(layer, "weight_qkv", None)
    if w is None or getattr(w, "tensor_model_parallel", False):
        return
    values = (True, 0, 1, layer.output_sizes[0] // layer.q_output_size_per_partition, None)
    for name, value in zip(TP_ATTRIBUTES, values, strict=True):
        setattr(w, name, value)


@torch.no_grad()
def move_parameters(model: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` as new tensors that keep their NxD attributes.

    ``Module.to`` cannot change an XLA parameter's device in place, so it makes new Parameters and drops what NxD
    set on the old ones (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel_enabled``...), which its
    gradient norm and ZeRO-1 read.
    """
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device != device:
                moved = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                moved.__dict__.update(p.__dict__)
                module._parameters[name] = moved
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
