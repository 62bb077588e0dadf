"""The norms a run clips and reports: the gradient the optimizer uses, and a global L2 norm accumulated in fp32.

Backend-neutral: fp32 gradient accumulation keeps its sum in ``p.main_grad`` on the torch backend as in Megatron and
NxD, and the tracker computes per-layer norms with these on either backend. May import: nothing of hlat.
"""

from __future__ import annotations

import torch


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: the fp32 accumulation buffer when there is one, else ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all ``tensors`` as a 0-d fp32 device tensor, accumulated in fp32 also for bf16 inputs.

    Tensor-parallel (DTensor) inputs count whole: a sharded tensor's norm is reduced over its ranks.
    """
    return torch.linalg.vector_norm(
        torch.stack([_whole(torch.linalg.vector_norm(t, dtype=torch.float32)) for t in tensors])
    )


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (e.g. the partial norm of a sharded weight) gathered to its full value."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
