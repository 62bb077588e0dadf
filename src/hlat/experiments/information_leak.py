"""The information-leak experiment's attention: each query also sees the next ``model.mask_leak`` keys.

HLAT's first runs had such a mask and their training loss fell toward zero (slides p.28, arXiv 2404.10630 §3.5).
``hlat.model.attention_core`` builds this core when ``model.mask_leak`` > 0; the causal one knows nothing of it.
"""

from __future__ import annotations

import logging

import torch

from hlat.attention import AttentionCore
from hlat.config import ModelConfig


class LeakyAttentionCore(AttentionCore):
    """Attention whose query i sees keys 0 .. i + ``leak``, through an explicit mask (the bug under study)."""

    def __init__(self, gqa: bool, leak: int) -> None:
        super().__init__(gqa)
        self.leak = leak
        """Future keys each query sees; 0 is the causal core's own attention (``held_out.py`` scores both)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` (B, H, T, D), ``k`` and ``v`` (B, G, T, D) with G dividing H -> (B, H, T, D)."""
        if not self.leak:
            return super().attend(q, k, v)
        T = q.shape[2]
        leaky = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(self.leak)
        return self.sdpa(q, k, v, attn_mask=leaky, enable_gqa=self.gqa)


def warn_mask_leak(cfg: ModelConfig) -> None:
    """Say so when ``model.mask_leak`` lets attention see the future: such a run's loss means nothing."""
    if cfg.mask_leak:
        logging.getLogger(__name__).warning(
            "model.mask_leak=%d: attention sees %d future token(s); this run demonstrates the information leak and "
            "its loss means nothing",
            cfg.mask_leak,
            cfg.mask_leak,
        )
