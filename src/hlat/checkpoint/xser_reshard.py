"""The pieces one rank of a new layout holds of a neuron checkpoint, read as byte ranges of the stored pieces.

A resume on another layout (``xser_write.resharded_copy``) writes, for its own rank, the xser files NxD loads. Each
of them holds a tensor-parallel piece of a weight or optimizer state, or its ZeRO-1 chunk: rows of the full tensor
(``neuron_shards.tp_index``) over a block of its columns. :func:`plan` says which rows and columns of which saved
files that target holds, as runs of consecutive stored rows (a row held twice, a norm or a tiled kv head, is taken
from its first tp rank, as the full reader does); :class:`RangedPieces` reads each run with ``os.preadv`` at its
offset in the file: ``torch.save`` stores a tensor's bytes uncompressed in one zip record, so the run's bytes are a
range of the file. A rank reads what it holds, never a whole tensor it does not, and only its stage's layers;
:func:`read_counts` counts it from the configs alone (``bench/reshard_reads.py``).

May import: ``hlat.config``, the core, ``hlat.backends.neuron_shards``, the rest of ``hlat.checkpoint``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from hlat.backends.neuron_shards import param_names, stage_of, tp_gather, tp_index, tp_split, zero1_rows, zero1_split
from hlat.checkpoint import ranges
from hlat.checkpoint.hf_layout import expected_shapes
from hlat.checkpoint.xser import STATE_KEYS, Layout, NeuronCheckpoint, disk_dtype
from hlat.config import ConfigError, ModelConfig, RunConfig


@dataclass(frozen=True)
class Run:
    """Consecutive rows of one saved file (tp rank ``t``, ZeRO-1 chunk ``d``), over a block of columns.

    ``rows`` rows from ``src_row`` on, columns ``[src_col, src_col + cols)``, into the target's rows from ``dst_row``,
    columns from ``dst_col``.
    """

    t: int
    d: int
    src_row: int
    dst_row: int
    rows: int
    src_col: int
    dst_col: int
    cols: int


@dataclass(frozen=True)
class Target:
    """One target file: ``shape`` (rows, or rows x columns), read as ``runs`` of saved files ``width_src`` wide.

    Rows past those the runs fill are ZeRO-1's padding (zeros).
    """

    shape: tuple[int, ...]
    shape_src: tuple[int, ...]
    """The shape of every saved file the runs read (a tp piece, or its ZeRO-1 chunk)."""
    runs: tuple[Run, ...]

    @property
    def width(self) -> int:
        """Columns of the target (1 for a 1-D tensor)."""
        return self.shape[1] if len(self.shape) == 2 else 1

    @property
    def width_src(self) -> int:
        """Columns of the saved files."""
        return self.shape_src[1] if len(self.shape_src) == 2 else 1

    def elements(self) -> int:
        """Elements the runs read: the target's own, without padding."""
        return sum(r.rows * r.cols for r in self.runs)


def plan(
    name: str, shape: tuple[int, ...], model: ModelConfig, src: tuple[int, int], dst: tuple[int, int], u: int, d: int
) -> Target:
    """The runs of saved files that make target piece ``u``'s chunk ``d`` of parameter-shaped tensor ``name``.

    Args:
        name: The parameter (its optimizer state is cut alike).
        shape: Its full shape (1-D or 2-D).
        model: The model config (the cuts of qkv and kv heads depend on it).
        src: ``(tp, chunks)`` of the saved layout: chunks is its dp under ZeRO-1 for optimizer state, else 1.
        dst: ``(tp, chunks)`` of the target layout.
        u: The target's tensor-parallel rank.
        d: The target's chunk (its data-parallel rank under ZeRO-1), else 0.
    """
    kind = re.sub(r"^layers\.\d+\.", "layers.0.", name)  # every layer is cut alike
    saved, holders = _cut(kind, tuple(shape), model, src[0])
    rows, cols = _cut(kind, tuple(shape), model, dst[0])[0][u]
    per = zero1_rows(len(rows), dst[1])
    want = rows[d * per : (d + 1) * per]
    per_src = zero1_rows(len(saved[0][0]), src[1])
    runs: list[Run] = []
    for block, (who, at) in holders.items():
        lo, hi = max(block.start, cols.start), min(block.stop, cols.stop)
        if lo < hi:
            runs += _runs(who[want], at[want], per_src, (lo - block.start, lo - cols.start, hi - lo))
    if len(shape) == 2:
        return Target((per, len(cols)), (per_src, len(saved[0][1])), tuple(runs))
    return Target((per,), (per_src,), tuple(runs))


def _runs(who: torch.Tensor, at: torch.Tensor, per: int, cols: tuple[int, int, int]) -> list[Run]:
    """Target rows i held by saved piece ``who[i]`` at its row ``at[i]``, as runs of consecutive stored rows."""
    if len(who) and int(who.min()) < 0:
        raise AssertionError("a target row is in no saved piece")  # a bug in the cuts, never a user's error
    chunk, row = at // per, at % per
    new = torch.ones(len(who), dtype=torch.bool)
    new[1:] = (who[1:] != who[:-1]) | (chunk[1:] != chunk[:-1]) | (row[1:] != row[:-1] + 1)
    starts = [*torch.nonzero(new).flatten().tolist(), len(who)]
    return [Run(int(who[a]), int(chunk[a]), int(row[a]), a, b - a, *cols) for a, b in itertools.pairwise(starts)]


_Cut = tuple[list[tuple[torch.Tensor, range]], dict[range, tuple[torch.Tensor, torch.Tensor]]]
_CUTS: dict[tuple, _Cut] = {}


def _cut(kind: str, shape: tuple[int, ...], model: ModelConfig, tp: int) -> _Cut:
    """``tp_index`` of a parameter kind, and per column block which piece first holds each full row, at which row.

    Cached: the planner asks for every layer of every rank of a 70B layout.
    """
    key = (kind, shape, tp, model.n_heads, model.kv_heads, model.head_dim)
    if key not in _CUTS:
        _CUTS[key] = _holders(tp_index(kind, shape, model, tp), shape[0])
    return _CUTS[key]


def _holders(pieces: list[tuple[torch.Tensor, range]], n_rows: int) -> _Cut:
    """The pieces, and per column block which piece first holds each of the ``n_rows`` full rows, at which row."""
    holders: dict[range, tuple[torch.Tensor, torch.Tensor]] = {}
    for t, (rows, cols) in enumerate(pieces):
        who, at = holders.setdefault(cols, (torch.full((n_rows,), -1), torch.full((n_rows,), -1)))
        free = who[rows] < 0
        who[rows[free]] = t
        at[rows[free]] = torch.arange(len(rows))[free]
    return pieces, holders


class Pieces(Protocol):
    """Where the xser writer gets each rank's piece.

    Cut from full tensors (:class:`Cutter`), or read as byte ranges of a neuron checkpoint's pieces
    (:class:`RangedPieces`).
    """

    def piece(self, name: str, param: str, t: int, d: int, chunks: int) -> torch.Tensor:
        """Tensor ``name`` (``model.<param>`` or ``optimizer.state.<param>.<key>``) as tp rank ``t`` holds it.

        Chunk ``d`` of ``chunks`` under ZeRO-1 (padded with zeros), in the dtype the source's reader gives.
        """
        ...


class Cutter:
    """Pieces cut from the full tensors of a reader, each full tensor read once (asked for one after the other)."""

    def __init__(self, read: Callable[[str], torch.Tensor], model: ModelConfig, tp: int) -> None:
        self.read, self.model, self.tp = read, model, tp
        self._name: str | None = None
        self._pieces: list[torch.Tensor] = []
        self._chunks: tuple[int, int, list[torch.Tensor]] | None = None

    def piece(self, name: str, param: str, t: int, d: int, chunks: int) -> torch.Tensor:
        if name != self._name:
            self._name, self._pieces, self._chunks = None, [], None  # the last tensor freed before the next is read
            full = self.read(name)
            self._pieces = [full] * self.tp if name.endswith(".step") else tp_split(param, full, self.model, self.tp)
            self._name = name
        if chunks == 1:
            return self._pieces[t]
        if self._chunks is None or self._chunks[:2] != (t, chunks):
            self._chunks = (t, chunks, zero1_split(self._pieces[t], chunks))
        return self._chunks[2][d]


class RangedPieces:
    """The pieces the ranks of a tp-``tp`` layout hold of a neuron checkpoint, each read as the byte ranges it needs.

    ``bytes_read`` counts the tensor bytes read (the small reference and info pickles aside); ``headers`` the saved
    files whose shape and dtype their info file did not give (their tensor header was read), ``whole`` those read
    whole because they do not hold one uncompressed contiguous tensor (none that NxD or hlat writes).
    """

    def __init__(self, source: NeuronCheckpoint, model: ModelConfig, tp: int) -> None:
        self.source, self.model, self.tp = source, model, tp
        self.bytes_read = self.headers = self.whole = 0
        self._records: dict[Path, _Record] = {}

    def piece(self, name: str, param: str, t: int, d: int, chunks: int) -> torch.Tensor:
        """Tensor ``name`` as tp rank ``t`` of the target holds it, chunk ``d`` of ``chunks``: see :class:`Pieces`."""
        src = self.source
        shape, dtype = src.tensors()[name]
        if name.endswith(".step"):  # a scalar, the same on every rank: the full reader takes tp rank 0's
            f = src.stored(name, 0)
            rec = self._record(f, None)
            out = torch.empty(rec.shape, dtype=rec.dtype)
            self._fill(out, f, [Run(0, 0, 0, 0, 1, 0, 0, out.numel())], None)
            return out.reshape(shape).to(dtype)
        lay = src.layout
        chunks_src = lay.dp if lay.zero1 and not name.startswith("model.") else 1
        target = plan(param, shape, self.model, (lay.tp, chunks_src), (self.tp, chunks), t, d)
        files = {(r.t, r.d): src.stored(name, r.t, r.d) for r in target.runs}
        stored = {self._record(f, target.shape_src).dtype for f in files.values()}
        if len(stored) != 1:
            raise ConfigError(f"neuron checkpoint {src.path}: the pieces of {name} are stored in dtypes {stored}")
        out = ranges.empty(target.shape, stored.pop())
        if sum(r.rows * r.cols for r in target.runs) < out.numel():
            out.zero_()  # ZeRO-1's padding, which no run covers
        for key, f in files.items():
            self._fill(out, f, [r for r in target.runs if (r.t, r.d) == key], target)
        return out.to(dtype)

    def _fill(self, out: torch.Tensor, f: Path, runs: list[Run], target: Target | None) -> None:
        """Copy ``runs`` of saved file ``f`` into ``out``: read at their offsets, or cut from the whole tensor.

        ``target`` None: one flat run.
        """
        width, width_src = (target.width, target.width_src) if target else (1, 1)
        offset = self._records[f].offset
        spans = [  # (target element, saved element, elements): a run of whole rows is one span
            (((r.dst_row + k) * width + r.dst_col), ((r.src_row + k) * width_src + r.src_col), r.cols * rows)
            for r in runs
            for rows in [r.rows if r.cols == width == width_src else 1]
            for k in range(0, r.rows, rows)
        ]
        flat = out.view(-1)
        if offset is None:  # not one uncompressed contiguous record: read it whole (counted), cut in memory
            whole = torch.load(f, map_location="cpu", weights_only=True).reshape(-1)
            self.bytes_read, self.whole = self.bytes_read + whole.nbytes, self.whole + 1
            for a, b, n in spans:
                flat[a : a + n] = whole[b : b + n]
            return
        size, view = out.element_size(), ranges.writable(out)
        fd = os.open(f, os.O_RDONLY)
        try:
            for a, b, n in spans:
                ranges.pread_into(fd, view[a * size : (a + n) * size], offset + b * size, f)
                self.bytes_read += n * size
        finally:
            os.close(fd)

    def _record(self, f: Path, shape: tuple[int, ...] | None) -> _Record:
        """Saved file ``f``'s dtype and where its data starts, checked to hold ``shape`` (None: any)."""
        if f not in self._records:
            self._records[f] = self._find(f)
        rec = self._records[f]
        if shape is not None and rec.shape != shape:
            raise ConfigError(
                f"neuron checkpoint {self.source.path}: {f.relative_to(self.source.path)} holds {rec.shape}, "
                f"its layout gives {shape}: it does not match its config"
            )
        return rec

    def _find(self, f: Path) -> _Record:
        """Where ``f``'s tensor bytes start, from the info file and the zip's directory (about 1 KiB read).

        Unless the zip holds one uncompressed record of exactly the bytes the info file gives: then the tensor's own
        header is read (``torch.load`` with ``mmap``, about 20 KiB, no data), and a tensor not stored contiguously is
        read whole.
        """
        info = self.source.stored_info(f)
        with open(f, "rb") as fh:
            if info is not None:
                shape, dtype = tuple(info["shape"]), info["dtype"]
                offset = ranges.data_offset(fh, math.prod(shape) * dtype.itemsize)
                if offset is not None:
                    return _Record(dtype, shape, offset)
            meta = torch.load(f, map_location="cpu", weights_only=True, mmap=True)  # maps the file, reads no data
            self.headers += 1
            whole = not meta.is_contiguous() or meta.storage_offset() or meta.untyped_storage().nbytes() != meta.nbytes
            return _Record(meta.dtype, tuple(meta.shape), None if whole else ranges.data_offset(fh, meta.nbytes))


@dataclass(frozen=True)
class _Record:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int | None
    """Where the tensor's bytes start in the file (None: not one uncompressed contiguous record)."""


class RangedCheckpoint(NeuronCheckpoint):
    """A neuron checkpoint whose full tensors are read as byte ranges straight into place (``hlat convert``).

    ``NeuronCheckpoint.read`` loads every piece and concatenates them: two copies of each byte; this reads each
    piece's rows into the full tensor (the tp = 1 piece, which only the fused qkv weight orders otherwise).
    """

    def read(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            return super().read(name)  # its KeyError
        shape = self._tensors[name][0]
        param = (
            name.removeprefix("model.")
            if name.startswith("model.")
            else name.removeprefix("optimizer.state.").rpartition(".")[0]
        )
        piece = RangedPieces(self, self.config.model, 1).piece(name, param, 0, 0, 1)
        return piece if name.endswith(".step") else tp_gather(param, [piece], self.config.model).reshape(shape)


@dataclass(frozen=True)
class RankReads:
    """The tensor bytes one rank of a new layout holds, and reads to reshard a checkpoint (the pickles aside)."""

    rank: int
    held: int
    """The tensors its files hold (ZeRO-1's padding included), in the new layout's dtypes."""
    after: int
    """What it reads as byte ranges (:class:`RangedPieces`)."""
    before: int
    """What reading full tensors read: every piece of every tensor of its stage, from every rank's files."""


def read_counts(saved: RunConfig, saved_dp: int, now: RunConfig, dp: int) -> list[RankReads]:
    """What each rank of ``now``'s layout (with ``dp``) reads to resume a neuron checkpoint of ``saved``'s.

    From the configs alone, nothing allocated (``bench/reshard_reads.py`` counts the paper's layouts).
    """
    src, dst = _layout(saved, saved_dp), _layout(now, dp)
    full = expected_shapes(now.model)
    keys = ["model", *STATE_KEYS, *(["master"] if now.precision.master_weights else [])]
    planned: dict[tuple, Target] = {}
    out = []
    for rank, (d, t, s) in enumerate(dst.ranks()):
        held = after = before = 0
        for name in (n for n in param_names(now.model) if stage_of(n, now.model, dst.pp) == s):
            for key in keys:
                own = f"model.{name}" if key == "model" else f"optimizer.state.{name}.{key}"
                read = f"model.{name}" if key == "master" and not saved.precision.master_weights else own
                src_size = disk_dtype(read, saved.precision).itemsize
                dst_size = disk_dtype(own, now.precision).itemsize
                if key == "step":  # a scalar, read from tp rank 0
                    held, after, before = held + dst_size, after + src_size, before + src_size
                    continue
                zero1 = (src.zero1 and read.startswith("optim"), dst.zero1 and key != "model")  # weights: whole
                chunks = (src.dp if zero1[0] else 1, dst.dp if zero1[1] else 1)
                at = (re.sub(r"^layers\.\d+\.", "layers.0.", name), chunks, t, d if chunks[1] > 1 else 0)
                if at not in planned:
                    planned[at] = plan(name, full[name], now.model, (src.tp, chunks[0]), (dst.tp, chunks[1]), *at[2:])
                target = planned[at]
                held += math.prod(target.shape) * dst_size
                after += target.elements() * src_size
                before += src.tp * chunks[0] * math.prod(target.shape_src) * src_size
        out.append(RankReads(rank, held, after, before))
    return out


def _layout(cfg: RunConfig, dp: int) -> Layout:
    par = cfg.parallelism
    return Layout(par.tp, par.pp, dp, par.zero1)
