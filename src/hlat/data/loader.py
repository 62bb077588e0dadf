"""The paper's online loader: shuffled documents, tokenized on the fly, packed per sequence slot of the global batch.

All epochs' shuffled documents form one global sequence: index ``i`` is position ``i % N`` of epoch ``i // N``'s
permutation of ``(seed, epoch)``. Sequence slot ``s`` of a ``G``-sequence global batch reads indices ``s, s + G,
s + 2G, ...`` and packs them into its own windows; global batch ``k`` is window ``k`` of every slot
(``hlat.data.slots``), whatever the data-parallel degree, micro-batch or accumulation split. A slot's position is
(document round, token offset), so a resumed stream yields exactly the tokens an uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hlat.config import ConfigError
from hlat.config.base import show
from hlat.data.identity import describe_change
from hlat.data.order import Permutation
from hlat.data.packing import Packer
from hlat.data.slots import slot_range
from hlat.data.sources import TextSource
from hlat.data.tokenizer import MAX_TRAIN_CHARS, Tokenizer

log = logging.getLogger(__name__)

STATE_VERSION = 3
START = {"round": 0, "offset": 0, "documents": 0, "skipped": 0, "windows": 0}
"""The cursor of a fresh sequence slot (see ``PackedStream.cursor``)."""
ENCODE_ROWS = 256  # rows per tokenizer call: 256 keeps both sentencepiece threads busy (64: -16% tokens/s)
EMPTY_EPOCHS = 8
"""A slot that reads this many times the corpus's rows in a row without a document gives up (a hang guard)."""


@dataclass(frozen=True)
class StreamSpec:
    """Everything needed to (re)build one rank's stream; picklable, so a worker process can."""

    data_path: str
    text_column: str
    tokenizer_path: str
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    seed: int
    shuffle: bool
    global_batch_size: int
    dp_rank: int
    dp_size: int

    @property
    def slots(self) -> range:
        """The sequence slots of the global batch this rank serves."""
        return slot_range(self.global_batch_size, self.dp_rank, self.dp_size)


def stream_identity(spec: StreamSpec, source: TextSource, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a saved stream position is only valid for: seed, shuffle, global batch, data and tokenizer."""
    return {
        "seed": spec.seed,
        "shuffle": spec.shuffle,
        "global_batch_size": spec.global_batch_size,
        "data": source.fingerprint,
        "tokenizer": tokenizer.fingerprint,
    }


_SETTINGS = {
    "loader": "data.loader",
    "seed": "train.seed",
    "shuffle": "data.shuffle",
    "seq_len": "train.seq_len",
    "global_batch_size": "train.global_batch_size",
}
"""Identity entries that are one config key each (the others: the data, the tokenizer)."""
CHECKPOINT = "<the checkpoint>"
"""Stands for the checkpoint in :func:`check_identity`'s message; ``hlat.train.resume.restore`` puts in its path."""
IDENTITY_KEYS = ("loader", "seed", "shuffle", "global_batch_size", "data", "tokenizer")
"""What the online loader's saved position is only valid for (the offline one adds ``seq_len``). Not the layout:
the position is per sequence slot of the global batch, and a change of ``train.global_batch_size`` would change
which documents every slot reads (refused, naming the key)."""


def check_identity(
    saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...] = IDENTITY_KEYS, version: int = STATE_VERSION
) -> None:
    """Refuse, in one line naming each change and the ways on, to resume a stream whose inputs changed."""
    saved, current = {"loader": "online", **saved}, {"loader": "online", **current}  # older states have no loader
    new_run = f"start a new run (a new hydra.run.dir; train.init_from={CHECKPOINT} keeps its trained weights)"
    if "online_mix" in (saved["loader"], current["loader"]) and saved["loader"] != current["loader"]:
        raise ConfigError(
            "the checkpoint's data stream mixed sources (data.mix), this run reads one corpus: resume with the "
            f"checkpoint's data.mix (and data.stages), or {new_run}"
        )
    if saved["loader"] != current["loader"]:  # the other entries of another loader's state mean other things
        keys = ("loader",)
    elif saved.get("version") != version:  # an older state has other entries: its version is what to report
        raise ConfigError(
            f"the checkpoint's data loader state has version {saved.get('version')}, this hlat reads version "
            f"{version}: resume with the hlat that wrote it, or {new_run}"
        )
    changes, restore = [], []
    for key in keys:
        old, new = saved.get(key), current[key]
        if old == new:
            continue
        if key == "data":
            if (change := describe_change(old, new)) is None:  # an older hlat's sizes-only identity, matched
                continue
            changes.append(change)
            restore.append("the data as it was")
        elif key == "tokenizer":
            changes.append(
                "the tokenizer is not the one the checkpoint was trained with (data.tokenizer / model.vocab_size; "
                "a tokenizer trained on the data changes with the data)"
            )
            restore.append("the same tokenizer")
        else:
            changes.append(f"{_SETTINGS[key]} was {show(old)}, is {show(new)} now")
            restore.append(f"{_SETTINGS[key]}={show(old)}")
    if changes:
        raise ConfigError(
            f"cannot resume the data stream exactly: {'; '.join(changes)}. Resume with {' and '.join(restore)}, "
            f"or {new_run}"
        )


class _Slot:
    """One sequence slot's packing state: it reads global indices ``slot, slot + G, ...`` (``round`` 0, 1, ...)."""

    def __init__(self, index: int, packer: Packer, cursor: dict[str, int]) -> None:
        self.index, self.packer = index, packer
        self.round, self.windows = int(cursor["round"]), int(cursor["windows"])
        self.documents, self.skipped = int(cursor["documents"]), int(cursor["skipped"])
        self.skip = int(cursor["offset"])  # tokens of the first document already trained on
        self.empty_run = 0  # rows read in a row without a document (the hang guard)

    def cursor(self) -> dict[str, int]:
        """Where this slot's next window starts, plus its counters as of that point (plain ints)."""
        at = self.packer.position()
        if at is None:  # nothing buffered: the next window starts with the next row to read
            at = ((self.round, self.documents, self.skipped), 0)
        (round_, documents, skipped), offset = at
        return {"round": round_, "offset": offset, "documents": documents, "skipped": skipped, "windows": self.windows}


class PackedStream:
    """Synchronous producer of packed windows for one rank's sequence slots (the worker runs one of these).

    Micro-batch ``j`` of a step is the next window of the rank's ``j``-th ``micro_batch_size`` slots. ``cursors``:
    where each slot of ``spec.slots`` starts, as :meth:`_Slot.cursor` returned it (keys of ``START``); None starts
    every slot at the beginning.
    """

    def __init__(
        self, spec: StreamSpec, source: TextSource, tokenizer: Tokenizer, cursors: list[dict] | None = None
    ) -> None:
        self.spec, self.source, self.tokenizer = spec, source, tokenizer
        slots = spec.slots
        if len(slots) % spec.micro_batch_size:
            raise ValueError(f"{len(slots)} slots per rank do not split into micro-batches of {spec.micro_batch_size}")
        cursors = cursors or [START] * len(slots)
        self._slots = [
            _Slot(s, Packer(spec.seq_len, tokenizer.eos_id), {**START, **c})
            for s, c in zip(slots, cursors, strict=True)
        ]
        self._perms: dict[int, Permutation] = {}
        self._rows_read, self._tokens_read = 0, 0  # for the size of the next tokenizer call

    def _row_of(self, index: np.ndarray) -> np.ndarray:
        """The source rows at global stream indices ``index``: epoch ``i // N``'s permutation of ``i % N``."""
        epoch, position = np.divmod(index, len(self.source))
        if not self.spec.shuffle:
            return position
        rows = np.empty_like(position)
        for e in np.unique(epoch).tolist():
            if e not in self._perms:
                if len(self._perms) >= 8:  # slots are at most a few epochs apart: keep the recent orders only
                    self._perms.pop(min(self._perms))
                self._perms[e] = Permutation(len(self.source), self.spec.seed, e)
            at = epoch == e
            rows[at] = self._perms[e](position[at])
        return rows

    def _plan(self, needy: _Slot) -> list[tuple[_Slot, int]]:
        """Rows to read for each slot running low, ``needy`` included: ~ENCODE_ROWS in all, for one tokenizer call.

        Every slot pops one window per global batch, so they run low together: each is topped up to one window
        plus ``ENCODE_ROWS / slots`` rows' worth of tokens, so that the next call, when the first slot runs dry, has
        about ENCODE_ROWS rows again. Only the speed depends on this.
        """
        per_row = self._tokens_read / self._rows_read if self._tokens_read else self.spec.seq_len
        ahead = self.spec.seq_len + 1 + ENCODE_ROWS * per_row / len(self._slots)
        plan = []
        for slot in self._slots:
            short = ahead - slot.packer.buffered
            if short > 0 or slot is needy:
                plan.append((slot, max(1, math.ceil(short / per_row))))
        total = sum(n for _, n in plan)
        if total < ENCODE_ROWS:  # long documents left some slots full: the others read more, for one full call
            plan = [(slot, math.ceil(n * ENCODE_ROWS / total)) for slot, n in plan]
        return plan

    def _feed(self, needy: _Slot) -> None:
        """Read, tokenize (in one call) and pack the next rows of every slot running low."""
        plan = self._plan(needy)
        size = self.spec.global_batch_size
        index = np.concatenate([s.index + size * np.arange(s.round, s.round + n, dtype=np.int64) for s, n in plan])
        docs = iter(self.source.get(self._row_of(index)))
        texts, owners = [], []
        for slot, n in plan:
            tags = []
            for _ in range(n):
                doc = next(docs)
                if doc is None:
                    slot.skipped, slot.empty_run = slot.skipped + 1, slot.empty_run + 1
                else:
                    tags.append((slot.round, slot.documents, slot.skipped))  # the cursor if a window starts here
                    texts.append(doc)
                    slot.documents, slot.empty_run = slot.documents + 1, 0
                slot.round += 1
            owners.append((slot, tags))
            if slot.empty_run >= EMPTY_EPOCHS * len(self.source):
                raise self.source.no_documents(
                    f"every value that sequence slot {slot.index} of the global batch (train.global_batch_size="
                    f"{size}) read, {slot.empty_run} rows in a row,"
                )
        encoded, at = self.tokenizer.encode(texts) if texts else [], 0
        self._rows_read += len(index)
        self._tokens_read += sum(len(ids) + 1 for ids in encoded)
        for slot, tags in owners:
            if tags:
                slot.packer.add(encoded[at : at + len(tags)], tags, skip=slot.skip)
                slot.skip, at = 0, at + len(tags)

    def _turn(self) -> int:
        """Index (in this rank's slots) of the next micro-batch's first slot: the first behind slot 0, else 0."""
        first = self._slots[0].windows
        return next((i for i, s in enumerate(self._slots) if s.windows < first), 0)

    def next_windows(self) -> tuple[np.ndarray, dict[int, dict[str, int]]]:
        """The next micro-batch as ``(micro_batch_size, seq_len + 1)`` windows, and its slots' cursors after it."""
        start = self._turn()
        group = self._slots[start : start + self.spec.micro_batch_size]
        windows = []
        for slot in group:
            while slot.packer.windows_ready() < 1:
                self._feed(slot)
            windows.append(slot.packer.pop())
            slot.windows += 1
        return np.stack(windows), {slot.index: slot.cursor() for slot in group}

    def cursors(self) -> list[dict[str, int]]:
        """Every slot's cursor, in slot order."""
        return [slot.cursor() for slot in self._slots]


def tokenizer_sample(source: TextSource, stride: int | None = None) -> list[str]:
    """Rows at an even stride, at most ~MAX_TRAIN_CHARS of text: bounded memory for any corpus size.

    ``stride``: every how many rows (default: the stride that gives ~MAX_TRAIN_CHARS of this source).
    """
    stride = stride or max(1, math.ceil(source.total_chars() / MAX_TRAIN_CHARS))
    sample: list[str] = []
    for lo in range(0, len(source), 1024 * stride):
        rows = np.arange(lo, min(lo + 1024 * stride, len(source)), stride)
        sample.extend(d for d in source.get(rows) if d is not None)
    return sample
