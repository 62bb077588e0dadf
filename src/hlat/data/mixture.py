"""A mixture's token stream: every sequence slot packs, per source, the documents that source's stream gives it.

The online loader's rule applied per source: source ``m``'s shuffled documents of all its epochs form one sequence
(index ``i``: position ``i % N_m`` of epoch ``i // N_m``'s permutation, the order ``data.path=<its path>`` would
read), and sequence slot ``s`` of a ``G``-sequence global batch reads its indices ``s, s + G, s + 2G, ...`` into a
packer of its own for that source. Which source fills slot ``s`` of global batch ``k`` is the schedule's
(``hlat.data.schedule``), so every window holds one source's documents only, and global batch ``k`` is the same on
every data-parallel degree and micro-batch split. A slot's position is, per source it has read, (document round,
token offset, counters): a resumed stream yields exactly the tokens an uninterrupted one would.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from hlat.config import ConfigError
from hlat.data.loader import EMPTY_EPOCHS, ENCODE_ROWS, StreamSpec
from hlat.data.order import Permutation
from hlat.data.packing import Packer
from hlat.data.schedule import Cursor, Schedule
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer

LOOKAHEAD = 64
"""Global batches ahead the planner looks for the windows a slot will need (it reads for at most these)."""
READ = ("round", "offset", "documents", "skipped")
SMALL_ROWS = 4096
"""A source of at most this many rows has its order computed whole per epoch (an array lookup then)."""
SMALL_CHARS = 1 << 20
"""A source of at most this many characters (and SMALL_ROWS rows) is read once and kept in memory..."""
KEPT_CHARS = 64 << 20
"""... while all kept sources hold at most this many characters."""
"""A slot's saved position in one source, as a list in this order."""


@dataclass(frozen=True)
class SourceRef:
    """One source of a mixture as a worker process reopens it."""

    name: str
    path: str
    text_column: str
    max_rows: int | None
    """Rows of its stream a slot may read below: ``data.mix.<name>.max_epochs`` x its rows (None: no cap)."""
    key: str
    """The config key of its cap, for the message when a run reaches it."""


@dataclass(frozen=True)
class MixSpec:
    """Everything needed to (re)build one rank's mixture stream; picklable, so a worker process can."""

    stream: StreamSpec
    """The rank's layout, tokenizer, seed and shuffle (its ``data_path`` is unused)."""
    sources: tuple[SourceRef, ...]
    """In the schedule's order (by name)."""
    schedule: Schedule


@functools.lru_cache(maxsize=4096)
def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The whole ``Permutation(n, seed, epoch)`` as an array (small ``n``; read-only, shared)."""
    order = Permutation(n, seed, epoch)(np.arange(n))
    order.flags.writeable = False
    return order


class _Slot:
    """One sequence slot: a packer and a position per source it has read."""

    def __init__(self, index: int, windows: int, read: dict[int, list[int]], seq_len: int, eos_id: int) -> None:
        self.index, self.windows, self.seq_len, self.eos_id = index, windows, seq_len, eos_id
        self.read = {m: [r[0], r[2], r[3]] for m, r in read.items()}  # round, documents, skipped
        self.skip = {m: r[1] for m, r in read.items()}  # tokens of the first document already trained on
        self.packers: dict[int, Packer] = {}
        self.empty_run: dict[int, int] = {}

    def packer(self, m: int) -> Packer:
        if m not in self.packers:
            self.packers[m] = Packer(self.seq_len, self.eos_id)
            self.read.setdefault(m, [0, 0, 0])
        return self.packers[m]

    def position(self, m: int) -> list[int]:
        """``[round, offset, documents, skipped]`` where source ``m``'s next window of this slot starts."""
        at = self.packers[m].position() if m in self.packers else None
        if at is None:
            (round_, documents, skipped), offset = tuple(self.read[m]), self.skip.get(m, 0)
        else:
            (round_, documents, skipped), offset = at
        return [round_, offset, documents, skipped]


class MixedStream:
    """Synchronous producer of a rank's mixture windows, one micro-batch at a time (the worker runs one).

    ``cursors``: each slot's saved position (``{"windows": n, "read": {source: READ values}}``), None for a fresh
    start; ``at``: the schedule's cursor before the first batch a slot has yet to give (the others are one ahead).
    """

    def __init__(
        self,
        spec: MixSpec,
        sources: list[TextSource],
        tokenizer: Tokenizer,
        cursors: list[dict] | None,
        at: Cursor,
    ) -> None:
        self.spec, self.sources, self.tokenizer = spec, sources, tokenizer
        s = spec.stream
        slots = s.slots
        if len(slots) % s.micro_batch_size:
            raise ValueError(f"{len(slots)} slots per rank do not split into micro-batches of {s.micro_batch_size}")
        index = {n: i for i, n in enumerate(spec.schedule.names)}
        cursors = cursors or [{"windows": at.batch, "read": {}}] * len(slots)
        self._slots = []
        for slot, c in zip(slots, cursors, strict=True):
            read = {index[n]: list(r) for n, r in c["read"].items() if n in index}
            assert int(c["windows"]) in (at.batch, at.batch + 1), (c["windows"], at.batch)  # mid-batch: some ahead
            self._slots.append(_Slot(slot, int(c["windows"]), read, s.seq_len, tokenizer.eos_id))
        self._ahead: deque[tuple[int, np.ndarray, Cursor]] = deque()  # (batch, source of each of my slots, after)
        self._next = at  # the schedule's cursor before the first batch not yet in _ahead
        self._perms: list[dict[int, Permutation | np.ndarray]] = [{} for _ in sources]
        self._texts: dict[int, list[str | None]] = {}  # the documents of small sources, read once
        self._kept_chars = 0
        self._per_row = [float(s.seq_len)] * len(sources)  # tokens per row read, per source (the read sizes)
        self._rows_read = [0] * len(sources)
        self._tokens_read = [0] * len(sources)

    def _extend(self, upto: int) -> None:
        """Plan the schedule up to batch ``upto`` (inclusive) for this rank's slots."""
        lo = self.spec.stream.slots.start
        while self._next.batch <= upto:
            count, after = self.spec.schedule.step(self._next)
            sources = self.spec.schedule.place(count, self._next.batch)[lo : lo + len(self._slots)]
            self._ahead.append((self._next.batch, sources, after))
            self._next = after

    def _assigned(self, batch: int) -> tuple[np.ndarray, Cursor]:
        """The source of each of this rank's slots in ``batch``, and the schedule's cursor after it."""
        self._extend(batch)
        first = self._ahead[0][0]
        _, sources, after = self._ahead[batch - first]
        return sources, after

    def _row_of(self, m: int, index: np.ndarray) -> np.ndarray:
        """Source ``m``'s rows at its stream indices ``index``: epoch ``i // N``'s permutation of ``i % N``."""
        n = len(self.sources[m])
        if self.spec.stream.shuffle and n <= SMALL_ROWS and len(index) <= 8:  # a few rows of a small source: no numpy
            seed = self.spec.stream.seed
            return np.array([_order(n, seed, i // n)[i % n] for i in index.tolist()], dtype=np.int64)
        epoch, position = np.divmod(index, n)
        if not self.spec.stream.shuffle:
            return position
        perms, rows = self._perms[m], np.empty_like(position)
        for e in np.unique(epoch).tolist():
            if e not in perms:
                if len(perms) >= 8:  # slots are at most a few epochs apart: keep the recent orders only
                    perms.pop(min(perms))
                # A small source's whole order, shared by the sources of its size: many small sources go through
                # many epochs
                perms[e] = (
                    _order(n, self.spec.stream.seed, e) if n <= SMALL_ROWS else Permutation(n, self.spec.stream.seed, e)
                )
            at, order = epoch == e, perms[e]
            rows[at] = order[position[at]] if isinstance(order, np.ndarray) else order(position[at])
        return rows

    def _documents(self, m: int, rows: np.ndarray) -> list[str | None]:
        """Source ``m``'s documents at ``rows``; a small source's are read once and kept (many small sources)."""
        if m not in self._texts:
            source = self.sources[m]
            chars = source.total_chars() if len(source) <= SMALL_ROWS else SMALL_CHARS + 1
            if chars > SMALL_CHARS or self._kept_chars + chars > KEPT_CHARS:
                return source.get(rows)
            self._texts[m], self._kept_chars = source.get(np.arange(len(source))), self._kept_chars + chars
        texts = self._texts[m]
        return [texts[r] for r in rows.tolist()]

    def _demand(self, needy: _Slot, m: int) -> dict[tuple[int, int], int]:
        """Rows to read per (slot, source) for the windows coming up: ~ENCODE_ROWS in all, for one tokenizer call.

        Each slot is topped up, source by source in the order its next windows need them, to one window plus its
        share of ``ENCODE_ROWS`` rows' worth of tokens (as the one-source stream does); only the speed depends on it.
        """
        low = min(s.windows for s in self._slots)
        self._extend(low + LOOKAHEAD - 1)
        first = self._ahead[0][0]
        ahead = np.stack([a[1] for a in list(self._ahead)[low - first : low - first + LOOKAHEAD]])  # (L, slots)
        budget = ENCODE_ROWS / len(self._slots)  # rows per slot
        for _ in range(4):  # what is buffered already is not read: look further ahead for one full tokenizer call
            plan = self._plan(needy, m, ahead, low, budget)
            total = sum(plan.values())
            if total >= ENCODE_ROWS:
                break
            budget *= 2 if not total else min(4.0, ENCODE_ROWS / total)
        return plan

    def _plan(self, needy: _Slot, m: int, ahead: np.ndarray, low: int, budget: float) -> dict[tuple[int, int], int]:
        """Rows per (slot, source) that cover each slot's next windows up to ``budget`` rows' worth of tokens."""
        seq_len, per_row = self.spec.stream.seq_len, np.asarray(self._per_row)
        plan: dict[tuple[int, int], int] = {}
        for i, slot in enumerate(self._slots):
            coming = ahead[slot.windows - low :, i]  # the sources of this slot's next windows
            rows = np.cumsum(seq_len / per_row[coming])  # rows read by the end of each
            n = max(1, min(len(coming), int(np.searchsorted(rows, budget)) + 1))
            sources, windows = np.unique(coming[:n], return_counts=True)
            for src, count in zip(sources.tolist(), windows.tolist(), strict=True):
                short = count * seq_len + 1 - (slot.packers[src].buffered if src in slot.packers else 0)
                if short > 0 or (slot is needy and src == m):
                    plan[(i, src)] = max(1, math.ceil(short / self._per_row[src]))
        return plan

    def _feed(self, needy: _Slot, m: int) -> None:
        """Read, tokenize (in one call) and pack the next rows of every (slot, source) running low."""
        size = self.spec.stream.global_batch_size
        plan = self._demand(needy, m)
        by_source: dict[int, list[tuple[_Slot, int, np.ndarray]]] = {}
        for (i, src), n in plan.items():
            slot = self._slots[i]
            slot.packer(src)
            start = slot.read[src][0]
            cap = self.spec.sources[src].max_rows
            index = slot.index + size * np.arange(start, start + n, dtype=np.int64)
            if cap is not None:
                index = index[index < cap]
                if not len(index) and slot is needy and src == m:
                    raise self._capped(slot, src, int(slot.index + size * start))
            if len(index):
                by_source.setdefault(src, []).append((slot, src, index))
        texts, owners = [], []
        for src, wanted in by_source.items():
            docs = iter(self._documents(src, self._row_of(src, np.concatenate([w[2] for w in wanted]))))
            for slot, _, index in wanted:
                tags = self._take(slot, src, docs, len(index), texts)
                owners.append((slot, src, tags))
                self._rows_read[src] += len(index)
        encoded = self.tokenizer.encode(texts) if texts else []
        at = 0
        for slot, src, tags in owners:
            if tags:
                got = encoded[at : at + len(tags)]
                self._tokens_read[src] += sum(len(ids) + 1 for ids in got)
                self._per_row[src] = self._tokens_read[src] / self._rows_read[src]
                slot.packers[src].add(got, tags, skip=slot.skip.pop(src, 0))
                at += len(tags)

    def _take(self, slot: _Slot, src: int, docs, n: int, texts: list[str]) -> list[tuple[int, int, int]]:
        """Take ``n`` rows of ``docs`` for ``slot``'s packer of ``src``: the documents' tags; skipped rows counted."""
        read, tags = slot.read[src], []
        for _ in range(n):
            doc = next(docs)
            if doc is None:
                read[2] += 1
                slot.empty_run[src] = slot.empty_run.get(src, 0) + 1
            else:
                tags.append((read[0], read[1], read[2]))  # the position if a window starts here
                texts.append(doc)
                read[1] += 1
                slot.empty_run[src] = 0
            read[0] += 1
        if slot.empty_run.get(src, 0) >= EMPTY_EPOCHS * len(self.sources[src]):
            raise self.sources[src].no_documents(
                f"every value that sequence slot {slot.index} read of source {self.spec.schedule.names[src]!r}, "
                f"{slot.empty_run[src]} rows in a row,"
            )
        return tags

    def _capped(self, slot: _Slot, src: int, index: int) -> ConfigError:
        ref, n = self.spec.sources[src], len(self.sources[src])
        return ConfigError(
            f"{ref.key}: global batch {slot.windows} (step {slot.windows + 1}) needs row {index:,} of source "
            f"{ref.name!r}'s stream, beyond its cap of {ref.max_rows:,} rows ({ref.max_rows / n:g} epochs of {n:,} "
            f"rows); raise {ref.key}, lower the source's weight, or add data to it"
        )

    def _turn(self) -> int:
        """Index (in this rank's slots) of the next micro-batch's first slot: the first behind slot 0, else 0."""
        first = self._slots[0].windows
        return next((i for i, s in enumerate(self._slots) if s.windows < first), 0)

    def next_windows(self) -> tuple[np.ndarray, dict]:
        """The next micro-batch as ``(micro_batch_size, seq_len + 1)`` windows, and what the loader keeps of it.

        The second is ``{"cursors": {slot: (windows, source, its READ position)} after it, "sources":
        (micro_batch_size,) source indices, "after": the schedule's cursor after this global batch}``: a slot's
        position changes only in the source it just gave a window of (what a feed changes is the same position).
        """
        start = self._turn()
        group = self._slots[start : start + self.spec.stream.micro_batch_size]
        batch = group[0].windows
        sources, after = self._assigned(batch)
        picked = sources[start : start + len(group)]
        windows = []
        for slot, m in zip(group, picked.tolist(), strict=True):
            packer = slot.packer(m)
            while packer.windows_ready() < 1:
                self._feed(slot, m)
            windows.append(packer.pop())
            slot.windows += 1
        low = min(s.windows for s in self._slots)
        while self._ahead and self._ahead[0][0] < low:
            self._ahead.popleft()  # every slot is past it
        names = self.spec.schedule.names
        moved = {s.index: (s.windows, names[m], s.position(m)) for s, m in zip(group, picked.tolist(), strict=True)}
        info = {"cursors": moved, "sources": picked.copy(), "after": after}
        return np.stack(windows), info
