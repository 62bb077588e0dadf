"""The HLAT decoder: a LLaMA-style transformer as single-device code (arXiv 2404.10630 §3.1, §3.5).

Pre-norm RMSNorm, rotary embeddings, GQA with one fused qkv (rows in kv groups ``[q_0 .. q_{r-1}, k, v]``, so a
column split hands each TP rank whole groups), SwiGLU with one fused gate_up, no mask tensor, untied LM head.
Blocks, attention cores and ``Linear`` layers compute through functions they hold (``run``, ``sdpa``, ``linear``),
which the torch backend sets; the attention core is the seam experiments and generation use. Imports only the
config, ``hlat.attention`` and the experiments' cores. Build on the meta device, ``to_empty``, then ``init_weights``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hlat.attention import AttentionCore, run_directly
from hlat.config import ModelConfig


class Linear(nn.Linear):
    """``nn.Linear`` that multiplies through its ``linear`` function; names, parameters and hooks are nn.Linear's."""

    linear = staticmethod(F.linear)
    """``F.linear``; the torch backend's emulated bf16 matmuls set an instance's to their own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision in bf16.
        return rms_norm(x, self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, computed in ``dtype`` and returned in ``x``'s dtype."""
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(dtype)).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None):
    """Cosine and sine tables for rotary embeddings, each (max_seq_len, head_dim) in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, D): the rotate-half convention of HF LLaMA
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, H, D) by position; ``cos``/``sin`` are (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with a fused, group-interleaved qkv projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per kv head
        self.qkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.core = attention_core(cfg, gqa=self.n_rep > 1)  # q, k, v -> y: replaceable (hlat.attention)
        self.o_proj = Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, dim) at the positions of ``cos``/``sin`` (T, D) -> (B, T, dim)."""
        B, T, _ = x.shape
        # -1 is the number of kv groups on this rank (all of them unless TP sharded the projection).
        qkv = self.qkv(x).view(B, T, -1, self.n_rep + 2, self.head_dim)  # (B, T, G, r+2, D)
        q = qkv[:, :, :, : self.n_rep].reshape(B, T, -1, self.head_dim)  # (B, T, G*r, D)
        k, v = qkv[:, :, :, self.n_rep], qkv[:, :, :, self.n_rep + 1]  # (B, T, G, D) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = self.core(q, k, v)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP with one fused gate_up projection: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down = Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows are [gate; up], so a column-wise TP split must interleave them (done by the backend).
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block; ``layer_id`` is 1-based (it sets the scaled init)."""

    run = staticmethod(run_directly)
    """How ``forward`` runs ``compute``; the torch backend's full activation checkpointing sets a recomputing one
    (inside ``forward``, so hooks on the block, e.g. FSDP2's, run once, outside the recomputation)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, dim) at the positions of ``cos``/``sin`` (T, D) -> (B, T, dim)."""
        return self.run(self.compute, x, cos, sin)

    def compute(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block itself, the part ``forward`` runs (and activation checkpointing recomputes)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: token ids (B, T) -> logits (B, T, vocab).

    The neuron backend's decoder (``hlat.backends.neuron_model.NeuronTransformer``) keeps this contract and takes
    optional labels on top, for which it returns the mean token loss (NxD's pipeline engine needs it in the model).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i + 1) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Derived from the config, so not saved in checkpoints; filled by init_weights().
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    @torch.no_grad()
    def init_rope(self) -> None:
        """(Re)compute the rotary tables in fp32; call again after casting the model to bf16 (``.to`` casts buffers)."""
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, self.rope_cos.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), a whole sequence from position 0 -> logits (B, T, vocab)."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.embed(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))  # (B, T, vocab)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter and buffer in place (after ``to_empty`` when built on meta).

        Each weight matrix is drawn from its own host generator keyed by ``seed`` and its name (``init_normal``),
        so the weights do not depend on which modules are initialized in which order: a tensor- or pipeline-parallel
        layout, or NxD materializing one stage, starts from exactly these weights. ``seed=None`` takes the seed from
        torch's global generator (``torch.manual_seed(s); model.init_weights()`` is reproducible).
        """
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, ()).item())
        stds = init_stds(self.cfg)
        self.init_rope()
        for name, p in self.named_parameters():
            if name in stds:
                p.copy_(init_normal(seed, name, p.shape, stds[name]))
            elif name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                raise AssertionError(f"no initialization for parameter {name}")


INIT_KEY_PRIME = 1_000_003


def init_generator(seed: int, name: str) -> torch.Generator:
    """The host generator of parameter ``name``: initialization keyed by (seed, name), not by draw order."""
    return torch.Generator().manual_seed((seed * INIT_KEY_PRIME + zlib.crc32(name.encode())) % (1 << 63))


def init_normal(seed: int, name: str, shape: Sequence[int], std: float) -> torch.Tensor:
    """The whole (unsharded) fp32 initial value of parameter ``name``: N(0, std^2) from ``init_generator``."""
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=init_generator(seed, name))


def init_stds(cfg: ModelConfig) -> dict[str, float]:
    """The init std of every weight matrix by name; output projections get std/sqrt(2l) when scaled (paper §4.3)."""
    std = cfg.init_std
    out: dict[str, float] = {"embed.weight": std, "lm_head.weight": std}
    for i in range(cfg.n_layers):
        out_std = std / math.sqrt(2 * (i + 1)) if cfg.scaled_init else std  # layer_id is 1-based
        out |= {
            f"layers.{i}.attn.qkv.weight": std,
            f"layers.{i}.attn.o_proj.weight": out_std,
            f"layers.{i}.mlp.gate_up.weight": std,
            f"layers.{i}.mlp.down.weight": out_std,
        }
    return out


def count_params(cfg: ModelConfig) -> int:
    """Parameter count, computed by building the model on the meta device (allocates nothing)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def attention_core(cfg: ModelConfig, gqa: bool) -> AttentionCore:
    """The attention core of ``cfg``: causal, or the information-leak experiment's when ``model.mask_leak`` > 0."""
    if cfg.mask_leak:  # imported only when asked for: the experiment is no part of the model
        from hlat.experiments.information_leak import LeakyAttentionCore

        return LeakyAttentionCore(gqa, cfg.mask_leak)
    return AttentionCore(gqa)
