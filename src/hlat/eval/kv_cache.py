"""Incremental decoding with a KV cache, outside the model: ``decode(model, tokens, cache, mask)``.

The model's forward knows no cache: ``decode`` swaps each block's attention core (``Attention.core``) for a
``CachedAttention`` for the duration of the call, so a token costs one position's work. Left-padded prompts decode
together, their pads masked out of the keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hlat.attention import AttentionCore
from hlat.model import Transformer


class LayerKV:
    """One layer's cached keys and values, (B, G, max_len, D) each, shaped by the first keys ``update`` writes."""

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
    """Per-layer keys and values of the positions decoded so far (``new_cache``); ``reset`` keeps the buffers.

    ``key_mask`` (B, max_len) is None until a ``decode`` passes a padding ``mask``, then True at real tokens.
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
        """Record which of the next ``length`` positions are real (``mask`` False at padding; None: all real).

        Returns the key mask to attend with, (B, pos + length), or None while nothing is padded.
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


def new_cache(model: Transformer, max_len: int | None = None) -> KVCache:
    """An empty ``KVCache`` for ``model`` and ``max_len`` positions (default ``model.max_seq_len``); lazy buffers."""
    return KVCache(len(model.layers), max_len or model.cfg.max_seq_len)


class CachedAttention(nn.Module):
    """A layer's attention core during ``decode``: the new keys and values join the cache, queries see all of it."""

    def __init__(self, core: AttentionCore, kv: LayerKV, key_mask: torch.Tensor | None) -> None:
        super().__init__()
        self.core, self.kv, self.key_mask = core, kv, key_mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` (B, H, T, D), ``k`` and ``v`` (B, G, T, D) -> (B, H, T, D)."""
        k, v = self.kv.update(k, v)  # (B, G, S, D): every cached position, these T last
        T, S = q.shape[2], k.shape[2]
        sdpa, gqa = self.core.sdpa, self.core.gqa  # the model's kernel (bf16_matmul may have set it)
        if self.key_mask is not None:
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            allowed = causal & self.key_mask[:, None, :]  # (B, T, S)
            own = torch.arange(T, device=q.device)
            allowed[:, own, own + (S - T)] = True  # a padded query sees itself: an empty mask row would give NaN
            return sdpa(q, k, v, attn_mask=allowed[:, None], enable_gqa=gqa)
        if S == T:  # from position 0: the model's own attention, exactly as in its forward
            return self.core(q, k, v)
        if T == 1:  # one new position sees every cached one: no mask at all
            return sdpa(q, k, v, enable_gqa=gqa)
        # Several new positions after cached ones (is_causal would align the triangle top-left): query i sees
        # keys 0 .. S-T+i. Built here from the shapes, like is_causal's mask.
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return sdpa(q, k, v, attn_mask=allowed, enable_gqa=gqa)


@contextlib.contextmanager
def _cached_cores(model: Transformer, cache: KVCache, key_mask: torch.Tensor | None) -> Iterator[None]:
    """Every block's attention core reads and extends its layer of ``cache`` inside the ``with``."""
    cores = [layer.attn.core for layer in model.layers]
    try:
        for layer, core, kv in zip(model.layers, cores, cache.layers, strict=True):
            layer.attn.core = CachedAttention(core, kv, key_mask)
        yield
    finally:
        for layer, core in zip(model.layers, cores, strict=True):
            layer.attn.core = core


def decode(model: Transformer, tokens: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids (B, T) at positions ``cache.pos`` onwards -> logits (B, T, vocab); appends them to ``cache``.

    ``mask`` (B, T) is False at left padding, which no later position attends to. From position 0 without padding
    the logits are exactly the model's forward's.
    """
    start, T = cache.pos, tokens.shape[1]
    if start + T > model.rope_cos.shape[0]:
        raise ValueError(f"positions {start}..{start + T - 1} exceed model.max_seq_len={model.cfg.max_seq_len}")
    if len(cache.layers) != len(model.layers):
        raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(model.layers)}")
    cos, sin = model.rope_cos[start : start + T], model.rope_sin[start : start + T]
    key_mask = cache.mark(mask, tokens.shape[0], T, tokens.device)  # (B, start + T), or None: no padding
    with _cached_cores(model, cache, key_mask):
        h = model.embed(tokens)  # (B, T, dim)
        for layer in model.layers:
            h = layer(h, cos, sin)
        return model.lm_head(model.norm(h))  # (B, T, vocab)
