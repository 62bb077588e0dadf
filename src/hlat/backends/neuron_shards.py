"""How the neuron backend's NxD layout cuts each full tensor: tensor-parallel shards, pipeline stages, ZeRO-1 chunks.

Pure tensor arithmetic, no files (``hlat.checkpoint.xser`` reads and writes their files). A full tensor is the torch
backend's at tp = pp = 1 (``hlat.model`` names and shapes); NxD's pieces are cut as its layers cut them at
initialization (``create_local_weight``; ``neuron_model`` says which layer each weight is):

- column-parallel (``lm_head``): rows split in tp contiguous blocks;
- ``gate_up`` (column-parallel, ``stride=2``): rank r holds ``[gate_r; up_r]``, the full weight is ``[gate; up]``;
- row-parallel (``o_proj``, ``down``): columns split in tp blocks;
- ``ParallelEmbedding`` (``embed``): the vocabulary (rows) split in tp blocks;
- ``GQAQKVColumnParallelLinear`` (``attn.qkv``, NxD's ``weight_qkv``): rank r holds ``[q_r; k_r; v_r]``, its query
  heads and the kv heads they read; with ``kv_size_multiplier`` m > 1 the kv heads are tiled m times first (trn1:
  rank r reads kv head r mod G). hlat's full ``qkv.weight`` interleaves them per kv group (``hlat.model``);
- anything else (norms) is replicated.

Pipeline stage s holds blocks ``[s L/pp, (s+1) L/pp)``, the embedding on the first stage, the final norm and
``lm_head`` on the last. ZeRO-1 (torch-xla's ``ZeroRedundancyOptimizer``) pads a tensor's first dimension to a
multiple of dp and gives data-parallel rank d the d-th chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hlat.backends.neuron_model import tp_style
from hlat.config import ModelConfig

QKV, NXD_QKV = "attn.qkv.weight", "attn.qkv.weight_qkv"
"""hlat's fused qkv weight and NxD's name for its ``GQAQKVColumnParallelLinear`` weight."""


def nxd_name(name: str) -> str:
    """NxD's parameter name of hlat's ``name`` (only the fused qkv weight differs)."""
    return name[: -len(QKV)] + NXD_QKV if name.endswith(QKV) else name


def hlat_name(name: str) -> str:
    """The hlat parameter name of NxD's ``name`` (the inverse of ``nxd_name``)."""
    return name[: -len(NXD_QKV)] + QKV if name.endswith(NXD_QKV) else name


def param_names(cfg: ModelConfig) -> list[str]:
    """Every parameter of the decoder, in ``named_parameters`` order (also the optimizer's, per stage)."""
    block = ("attn_norm.weight", QKV, "attn.o_proj.weight", "mlp_norm.weight", "mlp.gate_up.weight", "mlp.down.weight")
    layers = [f"layers.{i}.{p}" for i in range(cfg.n_layers) for p in block]
    return ["embed.weight", *layers, "norm.weight", "lm_head.weight"]


def stage_of(name: str, cfg: ModelConfig, pp: int) -> int:
    """The pipeline stage that holds parameter ``name`` (NxD's even ``auto_partition`` between blocks)."""
    if name.startswith("embed."):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) // (cfg.n_layers // pp)
    return pp - 1


def optimizer_order(names: list[str], ndims: list[int], decay_all: bool) -> list[str]:
    """The optimizer's parameter order over ``names`` (one stage's, in model order): ``hlat.optim.param_groups``.

    One group when ``optimizer.decay_norms_and_biases``, else the matrices first, then the 1-D parameters.
    """
    if decay_all:
        return list(names)
    return [n for n, d in zip(names, ndims, strict=True) if d >= 2] + [
        n for n, d in zip(names, ndims, strict=True) if d < 2
    ]


def _qkv_parts(full: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q (H*D, dim), k and v (G*D, dim) of hlat's group-interleaved qkv weight (``QKVInit.parts``)."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    groups = full.reshape(G, r + 2, D, *full.shape[1:])
    q = groups[:, :r].reshape(cfg.n_heads * D, *full.shape[1:])
    return q, groups[:, r].reshape(G * D, *full.shape[1:]), groups[:, r + 1].reshape(G * D, *full.shape[1:])


def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The group-interleaved qkv weight of hlat from q, k and v (the inverse of ``_qkv_parts``)."""
    G, r, D = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    rest = q.shape[1:]
    groups = torch.cat([q.reshape(G, r, D, *rest), k.reshape(G, 1, D, *rest), v.reshape(G, 1, D, *rest)], dim=1)
    return groups.reshape((cfg.n_heads + 2 * G) * D, *rest)


def kv_multiplier(cfg: ModelConfig, tp: int) -> int:
    """NxD's ``kv_size_multiplier``: copies of each kv head over the tensor-parallel ranks."""
    return max(1, tp // cfg.kv_heads)


def tp_split(name: str, full: torch.Tensor, cfg: ModelConfig, tp: int) -> list[torch.Tensor]:
    """The tp pieces NxD's ranks hold of hlat's full parameter ``name`` (or of a same-shaped AdamW moment)."""
    if name.endswith(QKV):  # [q; k; v] even at tp=1, where hlat interleaves them by kv group
        q, k, v = _qkv_parts(full, cfg)
        m = kv_multiplier(cfg, tp)
        k, v = (t.repeat(m, *[1] * (t.dim() - 1)) for t in (k, v))  # trn1's tiling of replicated kv heads
        return [torch.cat(parts) for parts in zip(q.chunk(tp), k.chunk(tp), v.chunk(tp), strict=True)]
    style = tp_style(name.removesuffix(".weight"))
    if style is None or tp == 1:
        return [full] * tp
    if name.endswith("mlp.gate_up.weight"):
        gate, up = full.chunk(2)
        return [torch.cat(parts) for parts in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    dim = 1 if style == "rowwise" and not name.startswith("embed.") else 0
    return list(full.chunk(tp, dim=dim))


def tp_gather(
    name: str,
    pieces: list[torch.Tensor],
    cfg: ModelConfig,
    new: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The full hlat parameter ``name`` from the pieces of NxD's tp ranks (the inverse of ``tp_split``).

    Replicated parameters and replicated kv heads are taken from their first copy. ``new(shape, dtype)``: where a
    gathered tensor's memory comes from (default ``torch.empty``'s; the qkv weight's regrouping is its own).
    """
    tp = len(pieces)
    if name.endswith(QKV):
        D, m = cfg.head_dim, kv_multiplier(cfg, tp)
        q_rows, kv_rows = cfg.n_heads * D // tp, cfg.kv_heads * D * m // tp
        qs, ks, vs = zip(*(p.split([q_rows, kv_rows, kv_rows]) for p in pieces), strict=True)
        copy = tp // m  # the ranks holding the first copy of every kv head
        return _qkv_full(torch.cat(qs), torch.cat(ks[:copy]), torch.cat(vs[:copy]), cfg)
    style = tp_style(name.removesuffix(".weight"))
    if style is None or tp == 1:
        return pieces[0]
    if name.endswith("mlp.gate_up.weight"):
        halves = [p.chunk(2) for p in pieces]
        return _cat([*(h[0] for h in halves), *(h[1] for h in halves)], 0, new)
    dim = 1 if style == "rowwise" and not name.startswith("embed.") else 0
    return _cat(pieces, dim, new)


def _cat(
    parts: list[torch.Tensor], dim: int, new: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None
) -> torch.Tensor:
    """``torch.cat(parts, dim)``, into memory from ``new`` where given."""
    if new is None:
        return torch.cat(parts, dim=dim)
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.cat(parts, dim=dim, out=new(tuple(shape), parts[0].dtype))


def tp_index(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> list[tuple[torch.Tensor, range]]:
    """Where each of the tp pieces of ``name`` (full ``shape``) lies in the full tensor, without the tensor.

    Piece t is ``full[rows][:, cols]``: ``rows`` the full tensor's row indices in the piece's order (int64), ``cols``
    its columns (``range(1)`` for a 1-D tensor). The cuts are ``tp_split``'s own, applied to row and column indices,
    so that they cannot disagree.
    """
    if len(shape) == 2 and tp_split(name, torch.empty(shape, device="meta"), cfg, tp)[0].shape[1] != shape[1]:
        cols = tp_split(name, torch.arange(shape[1])[None, :], cfg, tp)  # row-parallel: column blocks, every row
        return [(torch.arange(shape[0]), range(int(c[0, 0]), int(c[0, -1]) + 1)) for c in cols]
    width = range(shape[1]) if len(shape) == 2 else range(1)
    return [(rows, width) for rows in tp_split(name, torch.arange(shape[0]), cfg, tp)]


def zero1_rows(rows: int, dp: int) -> int:
    """Rows of each ZeRO-1 chunk of a tensor ``rows`` long in dim 0 (``zero1_split``: padded to a multiple of dp)."""
    return -(-rows // dp)


def zero1_split(local: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """The ZeRO-1 chunks of one rank's tensor: dim 0 padded to a multiple of dp, then dp equal chunks."""
    pad = -local.shape[0] % dp
    if pad:
        local = F.pad(local, [0, 0] * (local.dim() - 1) + [0, pad])
    return [c.clone() for c in local.chunk(dp)]


def zero1_gather(chunks: list[torch.Tensor], rows: int) -> torch.Tensor:
    """One rank's tensor from its ZeRO-1 chunks (the inverse of ``zero1_split``), ``rows`` long in dim 0."""
    return torch.cat(chunks)[:rows]
