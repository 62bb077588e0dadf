"""The paper's online loader: shuffled per-rank document streams, tokenized on the fly, packed.

Each epoch's order is a permutation of ``(seed, epoch)``; rank ``r`` of ``n`` reads positions ``r, r + n, ...``.
The position is (epoch, document, token offset), so a resumed stream yields exactly the tokens an uninterrupted
one would.
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
from hlat.data.sources import TextSource
from hlat.data.tokenizer import MAX_TRAIN_CHARS, Tokenizer

log = logging.getLogger(__name__)

STATE_VERSION = 2
START = {"epoch": 0, "position": 0, "offset": 0, "documents": 0, "skipped": 0, "batches": 0}
"""The cursor of a fresh stream (see ``PackedStream.cursor``)."""
ENCODE_ROWS = 256  # rows per tokenizer call: 256 keeps both sentencepiece threads busy (64: -16% tokens/s)


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
    dp_rank: int
    dp_size: int


def stream_identity(spec: StreamSpec, source: TextSource, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a saved stream position is only valid for: seed, shuffle, rank layout, data and tokenizer."""
    return {
        "seed": spec.seed,
        "shuffle": spec.shuffle,
        "dp_rank": spec.dp_rank,
        "dp_size": spec.dp_size,
        "data": source.fingerprint,
        "tokenizer": tokenizer.fingerprint,
    }


_SETTINGS = {"loader": "data.loader", "seed": "train.seed", "shuffle": "data.shuffle", "seq_len": "train.seq_len"}
"""Identity entries that are one config key each (the others: the data, the tokenizer, the rank layout)."""
CHECKPOINT = "<the checkpoint>"
"""Stands for the checkpoint in :func:`check_identity`'s message; ``hlat.train.resume.restore`` puts in its path."""
IDENTITY_KEYS = ("loader", "seed", "shuffle", "dp_rank", "dp_size", "data", "tokenizer")
"""What the online loader's saved position is only valid for (the offline one adds ``seq_len``)."""


def check_identity(
    saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...] = IDENTITY_KEYS, version: int = STATE_VERSION
) -> None:
    """Refuse, in one line naming each change and the ways on, to resume a stream whose inputs changed."""
    saved, current = {"loader": "online", **saved}, {"loader": "online", **current}  # older states have no loader
    changes, restore = [], []
    for key in keys:
        old, new = saved.get(key), current[key]
        if old == new or (key == "dp_rank" and saved.get("dp_size") != current["dp_size"]):
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
        elif key in ("dp_rank", "dp_size"):
            what = "data-parallel size" if key == "dp_size" else "data-parallel rank of this process"
            changes.append(f"the {what} was {old}, is {new} now")
            restore.append(f"the same {what} (world size / (parallelism.tp x parallelism.pp))")
        else:
            changes.append(f"{_SETTINGS[key]} was {show(old)}, is {show(new)} now")
            restore.append(f"{_SETTINGS[key]}={show(old)}")
    new_run = f"start a new run (a new hydra.run.dir; train.init_from={CHECKPOINT} keeps its trained weights)"
    if changes:
        raise ConfigError(
            f"cannot resume the data stream exactly: {'; '.join(changes)}. Resume with {' and '.join(restore)}, "
            f"or {new_run}"
        )
    if saved.get("version") != version:
        raise ConfigError(
            f"the checkpoint's data loader state has version {saved.get('version')}, this hlat reads version "
            f"{version}: resume with the hlat that wrote it, or {new_run}"
        )


def rows_per_rank(num_rows: int, dp_rank: int, dp_size: int) -> int:
    """Rows rank ``dp_rank`` reads per epoch: positions ``dp_rank, dp_rank + dp_size, ...`` below ``num_rows``."""
    return (num_rows - dp_rank + dp_size - 1) // dp_size


class PackedStream:
    """Synchronous producer of packed windows for one rank (the worker runs one of these).

    ``cursor``: where to start, as :meth:`cursor` returned it (keys of ``START``); None starts at the beginning.
    """

    def __init__(self, spec: StreamSpec, source: TextSource, tokenizer: Tokenizer, cursor: dict | None = None) -> None:
        self.spec, self.source, self.tokenizer = spec, source, tokenizer
        self.per_epoch = rows_per_rank(len(source), spec.dp_rank, spec.dp_size)
        if self.per_epoch == 0:
            raise ConfigError(
                f"the data has {len(source)} rows, fewer than the {spec.dp_size} data-parallel ranks; "
                "point data.path at more data or use fewer ranks"
            )
        c = {**START, **(cursor or {})}
        self.epoch, self.position, self.batches = int(c["epoch"]), int(c["position"]), int(c["batches"])
        self.documents, self.skipped = int(c["documents"]), int(c["skipped"])
        self._skip = int(c["offset"])  # tokens of the first document already trained on
        self._perm: Permutation | None = None
        self._perm_epoch = -1
        self.packer = Packer(spec.seq_len, tokenizer.eos_id)

    def _rows(self, lo: int, hi: int) -> np.ndarray:
        positions = np.arange(lo, hi, dtype=np.int64) * self.spec.dp_size + self.spec.dp_rank
        if not self.spec.shuffle:
            return positions
        if self._perm_epoch != self.epoch:
            self._perm, self._perm_epoch = Permutation(len(self.source), self.spec.seed, self.epoch), self.epoch
        return self._perm(positions)

    def _feed(self) -> None:
        """Read, tokenize and pack the next few rows of this rank's stream."""
        if self.position >= self.per_epoch:
            if self.documents == 0:  # a whole epoch of this rank's rows and not one document
                raise self.source.no_documents(f"every value of data-parallel rank {self.spec.dp_rank}'s share")
            self.epoch, self.position = self.epoch + 1, 0
        hi = min(self.position + ENCODE_ROWS, self.per_epoch)
        texts, tags = [], []
        for pos, doc in zip(range(self.position, hi), self.source.get(self._rows(self.position, hi)), strict=True):
            if doc is None:
                self.skipped += 1
                continue
            tags.append((self.epoch, pos, self.documents, self.skipped))  # the cursor if a window starts here
            texts.append(doc)
            self.documents += 1
        self.position = hi
        if texts:
            self.packer.add(self.tokenizer.encode(texts), tags, skip=self._skip)
            self._skip = 0

    def next_windows(self) -> tuple[np.ndarray, dict[str, int]]:
        """The next micro-batch as ``(micro_batch_size, seq_len + 1)`` windows, and the cursor after it."""
        while self.packer.windows_ready() < self.spec.micro_batch_size:
            self._feed()
        windows = np.stack([self.packer.pop() for _ in range(self.spec.micro_batch_size)])
        self.batches += 1
        return windows, self.cursor()

    def cursor(self) -> dict[str, int]:
        """Where the next window starts, plus the counters as of that point (plain ints)."""
        at = self.packer.position()
        if at is None:  # nothing buffered: the next window starts with the next row to read
            return {
                "epoch": self.epoch,
                "position": self.position,
                "offset": 0,
                "documents": self.documents,
                "skipped": self.skipped,
                "batches": self.batches,
            }
        (epoch, position, documents, skipped), offset = at
        return {
            "epoch": epoch,
            "position": position,
            "offset": offset,
            "documents": documents,
            "skipped": skipped,
            "batches": self.batches,
        }


def tokenizer_sample(source: TextSource) -> list[str]:
    """Rows at an even stride, at most ~MAX_TRAIN_CHARS of text: bounded memory for any corpus size."""
    stride = max(1, math.ceil(source.total_chars() / MAX_TRAIN_CHARS))
    sample: list[str] = []
    for lo in range(0, len(source), 1024 * stride):
        rows = np.arange(lo, min(lo + 1024 * stride, len(source)), stride)
        sample.extend(d for d in source.get(rows) if d is not None)
    return sample
