"""The HLAT decoder: a LLaMA-style transformer as single-device code.

Pre-norm RMSNorm, rotary position embeddings, grouped-query attention with ONE fused qkv projection,
SwiGLU with ONE fused gate_up projection, causal attention without a mask tensor, untied LM head
(arXiv 2404.10630 §3.1, §3.5). Nothing here is distributed or backend-specific: parallelism and precision are
applied from outside by ``hlat.backends``.

For generation, ``forward(tokens, cache)`` with a ``KVCache`` (``model.new_cache()``) runs incrementally: each call
appends its positions' keys and values to the cache and attends over everything cached, so decoding one token
costs one position's work. Training never passes a cache and runs exactly as before.

Prompts of different lengths decode together left-padded: ``forward(tokens, cache, mask)`` with ``mask`` (B, T) False
at the pads records them in ``cache.key_mask`` (B, max_len), and attention then skips those keys. Every row shares
one position per column; rotary embeddings make attention depend only on relative positions, so a row's real tokens
see what they would see unpadded.

Build on the meta device, materialize, then initialize::

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)

The fused qkv weight is laid out in key/value *groups*: rows ``[q_0 .. q_{r-1}, k, v]`` for each kv head,
r = n_heads / n_kv_heads (Megatron's layout). Splitting it column-wise over tensor-parallel ranks then
hands each rank whole groups, and ``forward`` infers the local head count with ``-1`` views.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hlat.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision in bf16.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


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


class AttentionCore(nn.Module):
    """Causal attention without projections, ``softmax(QK^T / sqrt(D)) V``; no parameters.

    A module of its own so that ``hlat.recompute`` can recompute just this part in the backward pass (selective
    activation checkpointing, Korthikanti et al. 2022): a kernel that materializes the (B, H, T, T) softmax keeps
    the only activations that grow with T^2 here, for a small share of the FLOPs.
    """

    sdpa = staticmethod(F.scaled_dot_product_attention)
    """The attention kernel; ``hlat.bf16_matmul`` sets an instance's to its fp32-emulated bf16 version."""

    def __init__(self, gqa: bool, leak: int = 0) -> None:
        super().__init__()
        self.gqa = gqa
        self.leak = leak
        """Future keys each query sees in training (``model.mask_leak``); 0, causal, except to demonstrate a leak."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``q`` (B, H, T, D), ``k`` and ``v`` (B, G, S, D) with G dividing H -> (B, H, T, D).

        The T queries are the last T of the S key positions: S == T in training, S > T when decoding with a
        ``KVCache`` (the keys then include every cached position). ``key_mask`` (B, S), only when decoding a
        left-padded batch, is False at padded keys: no query attends to them, except a padded query to itself (so
        that no row of the mask is empty, which would give NaN); the outputs at padded queries mean nothing.
        """
        T, S = q.shape[2], k.shape[2]
        if key_mask is not None:
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            allowed = causal & key_mask[:, None, :]  # (B, T, S)
            own = torch.arange(T, device=q.device)
            allowed[:, own, own + (S - T)] = True
            return self.sdpa(q, k, v, attn_mask=allowed[:, None], enable_gqa=self.gqa)
        if S == T and self.leak:  # the information-leak experiment only: query i also sees keys i+1 .. i+leak
            leaky = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(self.leak)
            return self.sdpa(q, k, v, attn_mask=leaky, enable_gqa=self.gqa)
        if S == T:
            # Causality comes from is_causal: the mask is built inside the kernel, never passed as an input
            # (a leaky input mask sent HLAT's loss to ~0, slides p.28). enable_gqa lets kv heads be shared.
            return self.sdpa(q, k, v, is_causal=True, enable_gqa=self.gqa)
        if T == 1:  # one new position sees every cached one: no mask at all
            return self.sdpa(q, k, v, enable_gqa=self.gqa)
        # Several new positions after cached ones (is_causal would align the triangle top-left): query i sees
        # keys 0 .. S-T+i. Built here from the shapes, like is_causal's mask.
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return self.sdpa(q, k, v, attn_mask=allowed, enable_gqa=self.gqa)


class LayerKV:
    """One layer's cached keys and values, (B, G, max_len, D) each, allocated at the first ``update``.

    The buffers take the dtype, device, batch size and (tensor-parallel local) kv head count of the first keys
    written, so the cache needs to know only its length.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.pos = 0
        """Positions cached so far."""
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k`` and ``v`` (B, G, T, D); return every cached position's keys and values, (B, G, pos, D)."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} do not fit (start a new cache)")
        if self.k is None or self.k.shape[:2] != k.shape[:2] or self.k.dtype != k.dtype or self.k.device != k.device:
            if self.pos:
                raise ValueError(f"keys of shape {tuple(k.shape)} do not continue the cached {tuple(self.k.shape)}")
            B, G, _, D = k.shape
            self.k = k.new_empty(B, G, self.max_len, D)
            self.v = v.new_empty(B, G, self.max_len, D)
        self.k[:, :, self.pos : end] = k
        self.v[:, :, self.pos : end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Per-layer keys and values of the positions decoded so far (``Transformer.new_cache``).

    ``forward(tokens, cache)`` places ``tokens`` at positions ``pos .. pos+T-1`` and advances ``pos`` by T.
    ``reset`` empties the cache and keeps its buffers for the next sequence of the same batch size.

    ``key_mask`` (B, max_len) bool is None until a forward passes a padding ``mask``; from then on it holds, for
    every cached position, whether it is a real token (True) or padding, and later calls without a mask mark
    their positions real.
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        if max_len <= 0:
            raise ValueError(f"a KV cache needs a positive length, got {max_len}")
        self.max_len = max_len
        self.layers = [LayerKV(max_len) for _ in range(n_layers)]
        self.key_mask: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        """Positions cached so far (the position of the next token)."""
        return self.layers[0].pos if self.layers else 0

    def reset(self) -> None:
        """Forget every cached position (the buffers stay allocated)."""
        for layer in self.layers:
            layer.pos = 0
        self.key_mask = None

    def mark(self, mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
        """Record which of the next ``length`` positions are real, and return the key mask to attend with.

        ``mask`` (B, T) is False at padding; None marks every position real. Returns ``key_mask`` over every
        position cached once these are, (B, pos + length), or None while nothing is padded.
        """
        start = self.pos
        if mask is None and self.key_mask is None:
            return None
        if self.key_mask is None or self.key_mask.shape[0] != batch or self.key_mask.device != device:
            if start and self.key_mask is not None:
                raise ValueError(f"tokens of {batch} rows do not continue the cached {self.key_mask.shape[0]}")
            # Positions cached before any mask are all real.
            self.key_mask = torch.ones(batch, self.max_len, dtype=torch.bool, device=device)
        end = min(start + length, self.max_len)  # overflow: LayerKV.update raises the clear error
        if mask is None:
            self.key_mask[:, start:end] = True
        else:
            if mask.shape != (batch, length):
                raise ValueError(f"mask of shape {tuple(mask.shape)} for tokens of shape {(batch, length)}")
            self.key_mask[:, start:end] = mask[:, : end - start].to(device=device, dtype=torch.bool)
        return self.key_mask[:, : start + length]


class Attention(nn.Module):
    """Causal grouped-query self-attention with a fused, group-interleaved qkv projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per kv head
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.core = AttentionCore(gqa=self.n_rep > 1, leak=cfg.mask_leak)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (B, T, dim) at the positions of ``cos``/``sin`` (T, D) -> (B, T, dim); ``cache`` holds earlier ones.

        ``key_mask`` (B, S) with a cache: False at the padded positions among the S cached ones (these T included).
        """
        B, T, _ = x.shape
        # -1 is the number of kv groups on this rank (all of them unless TP sharded the projection).
        qkv = self.qkv(x).view(B, T, -1, self.n_rep + 2, self.head_dim)  # (B, T, G, r+2, D)
        q = qkv[:, :, :, : self.n_rep].reshape(B, T, -1, self.head_dim)  # (B, T, G*r, D)
        k, v = qkv[:, :, :, self.n_rep], qkv[:, :, :, self.n_rep + 1]  # (B, T, G, D) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, G, S, D): every cached position, these T last
        y = self.core(q, k, v) if key_mask is None else self.core(q, k, v, key_mask)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP with one fused gate_up projection: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows are [gate; up], so a column-wise TP split must interleave them (done by the backend).
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block; ``layer_id`` is 1-based (it sets the scaled init)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.attn_norm(x)
        # Training calls attn with exactly (h, cos, sin): tensor parallelism's PrepareModuleInput expects three inputs.
        x = x + (self.attn(h, cos, sin) if cache is None else self.attn(h, cos, sin, cache, key_mask))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i + 1) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Derived from the config, so not saved in checkpoints; filled by init_weights().
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    @torch.no_grad()
    def init_rope(self) -> None:
        """(Re)compute the rotary tables in fp32; call again after casting the model to bf16 (``.to`` casts buffers)."""
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, self.rope_cos.device)

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab).

        With ``cache``, ``tokens`` continue the cached positions (``cache.pos`` onwards), attend to them too, and
        are appended to the cache; without, they are a whole sequence from position 0 (training). ``mask`` (B, T)
        bool, with a cache only, is False at padding (left padding of a batch of prompts): no later position
        attends to it, and the logits at padded positions mean nothing.
        """
        if cache is not None:
            return self._forward_cached(tokens, cache, mask)
        if mask is not None:
            raise ValueError("a padding mask needs a KV cache (model(tokens, model.new_cache(), mask))")
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.embed(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))  # (B, T, vocab)

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache, mask: torch.Tensor | None) -> torch.Tensor:
        start, T = cache.pos, tokens.shape[1]
        if start + T > self.rope_cos.shape[0]:
            raise ValueError(f"positions {start}..{start + T - 1} exceed model.max_seq_len={self.cfg.max_seq_len}")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(self.layers)}")
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        key_mask = cache.mark(mask, tokens.shape[0], T, tokens.device)  # (B, start + T), or None: no padding
        h = self.embed(tokens)  # (B, T, dim)
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            h = layer(h, cos, sin, kv, key_mask)
        return self.lm_head(self.norm(h))  # (B, T, vocab)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty ``KVCache`` for ``max_len`` positions (default ``model.max_seq_len``); buffers come lazily."""
        return KVCache(len(self.layers), max_len or self.cfg.max_seq_len)

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
        out |= {f"layers.{i}.attn.qkv.weight": std, f"layers.{i}.attn.o_proj.weight": out_std,
                f"layers.{i}.mlp.gate_up.weight": std, f"layers.{i}.mlp.down.weight": out_std}  # fmt: skip
    return out


def count_params(cfg: ModelConfig) -> int:
    """Parameter count, computed by building the model on the meta device (allocates nothing)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def warn_mask_leak(cfg: ModelConfig) -> None:
    """Say so when ``model.mask_leak`` lets attention see the future: such a run's loss means nothing."""
    if cfg.mask_leak:
        logging.getLogger(__name__).warning(
            "model.mask_leak=%d: attention sees %d future token(s); this run demonstrates the information leak and "
            "its loss means nothing", cfg.mask_leak, cfg.mask_leak)  # fmt: skip
