"""Sizes that follow from the configuration alone, without torch: parameters, bytes per parameter, FLOPs per token.

The config-only commands (``hlat summary``, ``hlat plan``) and the planner use these, so that they start without
importing torch; the trainer uses the same functions (``hlat.track.metrics`` re-exports ``flops_per_token``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config import ModelConfig, PrecisionConfig

BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per element of each supported dtype name."""


def count_params(cfg: ModelConfig) -> int:
    """The parameter count of ``hlat.model.Transformer(cfg)``, by arithmetic (``hlat.model.count_params`` builds it).

    Embedding and untied LM head (V x d each), the final RMSNorm (d), and per block: two RMSNorms (2d), the fused qkv
    projection (d x (H + 2K) x head_dim), the output projection (H x head_dim x d), the fused SwiGLU gate_up
    (d x 2F) and down (F x d) projections; no biases. The rotary tables are buffers, not parameters.
    """
    d, hd = cfg.dim, cfg.head_dim
    attn = d * (cfg.n_heads + 2 * cfg.kv_heads) * hd + cfg.n_heads * hd * d
    block = 2 * d + attn + 3 * d * cfg.ffn_dim
    return 2 * cfg.vocab_size * d + d + cfg.n_layers * block


def flops_per_token(
    n_params: int, n_embedding: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int, *, causal: bool = False
) -> float:
    """Training FLOPs per token, PaLM's formula (Chowdhery et al. 2022, App. B): 6N + 12·L·H·Q·T.

    N counts the parameters that take part in matmuls: all of them minus the input embedding table (a lookup).
    12·L·H·Q·T is the attention score and value matmuls, forward and backward, over the full T x T matrix.
    ``causal=True`` halves that term (6·L·H·Q·T): the FLOPs a causal kernel actually needs.
    """
    attn = (6 if causal else 12) * n_layers * n_heads * head_dim * seq_len
    return 6 * (n_params - n_embedding) + attn


@dataclass(frozen=True)
class BytesPerParam:
    """Training-state bytes per parameter under a precision mode, before any sharding."""

    params: int
    """The model's parameters."""
    grads: int
    """Gradients (the fp32 accumulation buffer when there is one)."""
    optimizer: int
    """AdamW's two moments."""
    master: int
    """The fp32 master copy (0 without master weights)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master

    def as_params(self) -> dict[str, int]:
        """Flat run parameters for the tracker."""
        return {f"memory.bytes_per_param.{k}": v for k, v in vars(self).items()} | {
            "memory.bytes_per_param.total": self.total
        }


def bytes_per_param(p: PrecisionConfig) -> BytesPerParam:
    """Memory accounting of a mode: fp32 16 B, bf16 / bf16_sr 8 B (10 with fp32_grad_accum), master_weights 18 B."""
    low = p.param_dtype != "float32"
    return BytesPerParam(
        params=BYTES[p.param_dtype],
        grads=4 if (p.fp32_grad_accum or not low) else BYTES[p.param_dtype],
        optimizer=2 * BYTES[p.optimizer_dtype],
        master=4 if p.master_weights else 0,
    )
