"""The attention core, ``softmax(QK^T / sqrt(D)) V`` without projections: the seam for attention implementations.

``hlat.model.Attention`` projects, rotates and calls its ``core`` module; what happens between q, k, v and the
output is the core's. The torch backend recomputes cores in the backward pass (``run``) and may set their kernel
(``sdpa``), the information-leak experiment (``hlat.experiments.information_leak``) brings a core of its own, and
generation (``hlat.eval.kv_cache``) swaps in one that reads and extends a KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def run_directly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: how a module runs its computation until a backend sets another way (its ``run``)."""
    return fn(*args)


class AttentionCore(nn.Module):
    """Causal attention without projections, ``softmax(QK^T / sqrt(D)) V``; no parameters.

    A module of its own so that just this part can be recomputed in the backward pass (selective activation
    checkpointing, Korthikanti et al. 2022): a kernel that materializes the (B, H, T, T) softmax keeps the only
    activations that grow with T^2 here, for a small share of the FLOPs. Other cores override ``attend``.
    """

    sdpa = staticmethod(F.scaled_dot_product_attention)
    """The attention kernel; the torch backend's emulated bf16 matmuls set an instance's to their own."""
    run = staticmethod(run_directly)
    """How ``forward`` runs ``attend``; the torch backend's selective activation checkpointing sets a recomputing
    one (inside ``forward``, so hooks on the core run once, outside the recomputation)."""

    def __init__(self, gqa: bool) -> None:
        super().__init__()
        self.gqa = gqa
        """Whether kv heads are shared by several query heads (``enable_gqa`` of the kernel)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` (B, H, T, D), ``k`` and ``v`` (B, G, T, D) with G dividing H -> (B, H, T, D)."""
        return self.run(self.attend, q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention itself, the part ``forward`` runs (and activation checkpointing recomputes)."""
        # Causality comes from is_causal: the mask is built inside the kernel, never passed as an input
        # (a leaky input mask sent HLAT's loss to ~0, slides p.28). enable_gqa lets kv heads be shared.
        return self.sdpa(q, k, v, is_causal=True, enable_gqa=self.gqa)
