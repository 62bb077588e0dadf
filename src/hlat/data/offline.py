"""The ``data.loader=offline_packed`` baseline: sample fixed windows by index from a pre-tokenized corpus.

The NeMo/Megatron ``GPTDataset`` scheme the HLAT paper's dataloader ablation (arXiv 2404.10630) compares its online
loader with, and reports overfit "because of repetition within sequences". The cache it reads is written by
``hlat.data.pretokenized``. Imports ``hlat.config`` and ``hlat.data`` only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hlat.config import ConfigError, DataConfig
from hlat.data.loader import check_identity
from hlat.data.pretokenized import pretokenize
from hlat.data.slots import covers, slot_range
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_STATE_VERSION = 2
_CACHED_EPOCHS = 3  # epochs of index arrays kept in memory (a window may reach into the next epoch)

IDENTITY_KEYS = ("loader", "seed", "shuffle", "seq_len", "global_batch_size", "data", "tokenizer")
"""state_dict entries that must match on resume (``hlat.data.loader.check_identity`` words a change)."""


class SampleIndex:
    """Megatron's ``doc_idx`` / ``sample_idx`` / ``shuffle_idx`` over an endless stream of epochs.

    ``doc_idx`` concatenates one shuffled document order per epoch into an endless EOS-joined stream; sample ``s``
    is stream tokens ``[s * seq_len, (s + 1) * seq_len]`` (``seq_len + 1`` tokens, so neighbours share one),
    located by ``sample_idx`` = (doc_idx position, offset); ``shuffle_idx`` permutes the samples starting in each
    epoch. The arrays are built per epoch when first needed (Megatron shuffles all epochs but the last together;
    per-epoch shuffles let the index grow lazily). Sequence slot ``s`` of global batch ``k`` is
    ``shuffle_idx[k * global_batch_size + s]``, whichever rank serves it (``hlat.data.slots``).

    ``doc_lengths`` counts each document's EOS; ``seed`` seeds every epoch's document order and sample
    permutation (numpy PCG64); ``shuffle=False`` keeps both in source order.
    """

    def __init__(self, doc_lengths: np.ndarray, seq_len: int, seed: int, shuffle: bool = True) -> None:
        self.lengths = np.asarray(doc_lengths, dtype=np.int64)
        self.num_docs, self.tokens_per_epoch = len(self.lengths), int(self.lengths.sum())
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}
        self._samples: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _permutation(self, n: int, epoch: int, what: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        seq = np.random.SeedSequence([self.seed & (2**64 - 1), epoch, what])
        return np.random.Generator(np.random.PCG64(seq)).permutation(n)

    @staticmethod
    def _remember(cache: dict, key: int, value: Any) -> None:
        cache[key] = value
        while len(cache) > _CACHED_EPOCHS:  # forget the epoch cached first, never the one just added
            del cache[next(k for k in cache if k != key)]

    def first_sample(self, epoch: int) -> int:
        """Index of the first sample whose window starts in ``epoch`` (samples are numbered in stream order)."""
        return -(-epoch * self.tokens_per_epoch // self.seq_len)

    def epoch_of(self, sample: int) -> int:
        """The epoch in which ``sample`` (or training position ``sample``) starts."""
        return sample * self.seq_len // self.tokens_per_epoch

    def doc_idx(self, epoch: int) -> np.ndarray:
        """Document order of ``epoch``: a permutation of all documents."""
        if epoch not in self._orders:
            self._remember(self._orders, epoch, self._permutation(self.num_docs, epoch, 0))
        return self._orders[epoch]

    def _epoch_samples(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._samples:
            first, end = self.first_sample(epoch), self.first_sample(epoch + 1)
            cum = np.cumsum(self.lengths[self.doc_idx(epoch)])
            local = np.arange(first, end, dtype=np.int64) * self.seq_len - epoch * self.tokens_per_epoch
            pos = np.searchsorted(cum, local, side="right")
            sample_idx = np.stack([pos, local - np.where(pos > 0, cum[pos - 1], 0)], axis=1)
            self._remember(self._samples, epoch, (sample_idx, first + self._permutation(end - first, epoch, 1)))
        return self._samples[epoch]

    def sample_idx(self, sample: int) -> tuple[int, int]:
        """(position in the epoch's ``doc_idx``, token offset in that document) where ``sample`` starts."""
        epoch = self.epoch_of(sample)
        pos, offset = self._epoch_samples(epoch)[0][sample - self.first_sample(epoch)]
        return int(pos), int(offset)

    def shuffle_idx(self, position: int) -> int:
        """The sample at training position ``position``; each epoch's samples are permuted among themselves."""
        epoch = self.epoch_of(position)
        return int(self._epoch_samples(epoch)[1][position - self.first_sample(epoch)])

    def window(self, sample: int, tokens: np.ndarray, doc_offsets: np.ndarray) -> np.ndarray:
        """The ``seq_len + 1`` tokens of ``sample`` (int64), read from ``tokens``/``doc_offsets``."""
        epoch = self.epoch_of(sample)
        pos, offset = self.sample_idx(sample)
        need, parts = self.seq_len + 1, []
        while need > 0:
            doc = self.doc_idx(epoch)[pos]
            lo = int(doc_offsets[doc]) + offset
            hi = min(int(doc_offsets[doc + 1]), lo + need)
            parts.append(tokens[lo:hi])
            need, offset, pos = need - (hi - lo), 0, pos + 1
            if pos == self.num_docs:
                epoch, pos = epoch + 1, 0
        return np.concatenate(parts).astype(np.int64)


class OfflinePackedLoader:
    """Infinite iterator of ``(inputs, targets)`` micro-batches of pre-tokenized windows for one DP rank.

    Same interface as the online loader. ``directory`` is a :func:`pretokenize` cache built with
    ``tokenizer``; ``data_fingerprint`` (``TextSource.fingerprint``), the tokenizer, ``seed``
    (``train.seed``), ``shuffle`` (``data.shuffle``), ``seq_len`` and ``global_batch_size`` are checked on
    resume. The position is one number per sequence slot, the windows it has served, so a resumed loader
    reproduces the batches exactly on any data-parallel degree and ``micro_batch_size``.
    """

    def __init__(
        self,
        directory: Path,
        tokenizer: Tokenizer,
        data_fingerprint: str,
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
        global_batch_size: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.tokens = np.memmap(self.directory / "tokens.bin", dtype=self.meta["dtype"], mode="r")
        self.doc_offsets = np.load(self.directory / "doc_offsets.npy", mmap_mode="r")
        self.tokenizer = tokenizer
        self.data_fingerprint = data_fingerprint
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.seed, self.shuffle, self.dp_rank, self.dp_size = seed, shuffle, dp_rank, dp_size
        self.global_batch_size = global_batch_size or micro_batch_size * dp_size
        self.slots = slot_range(self.global_batch_size, dp_rank, dp_size)
        self.index = SampleIndex(np.diff(self.doc_offsets), seq_len, seed, shuffle)
        self.windows = [0] * len(self.slots)  # per slot: the windows served (the global batch it is at)

    @property
    def num_documents(self) -> int:
        """Documents in the pre-tokenized corpus (skipped rows excluded)."""
        return self.index.num_docs

    def global_sample(self, i: int) -> int:
        """The global sample that is this rank's ``i``-th: slot ``i % slots`` of its ``i // slots``-th global batch."""
        k, j = divmod(i, len(self.slots))
        return self.index.shuffle_idx(k * self.global_batch_size + self.slots[j])

    def window(self, sample: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of global ``sample``."""
        return self.index.window(sample, self.tokens, self.doc_offsets)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch: int64 ``(inputs, targets)`` of shape ``(micro_batch_size, seq_len)``."""
        first = self.windows[0]
        start = next((j for j, n in enumerate(self.windows) if n < first), 0)  # slot 0 is a step ahead: behind it
        rows = []
        for j in range(start, start + self.micro_batch_size):
            rows.append(self.window(self.index.shuffle_idx(self.windows[j] * self.global_batch_size + self.slots[j])))
            self.windows[j] += 1
        windows = torch.from_numpy(np.stack(rows))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position (windows per slot) and the identity of the stream, as plain Python values."""
        return {
            "version": _STATE_VERSION,
            "loader": "offline_packed",
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "data": self.data_fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "slots": [self.slots.start, self.slots.stop],
            "cursors": list(self.windows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; later batches equal those of the saving loader.

        ``state`` holds this rank's slots (as :func:`hlat.data.slots.gather` assembles them on another layout).

        Raises:
            ConfigError: The state comes from the online loader, another seed, shuffle setting,
                seq_len, global batch, data or tokenizer.
        """
        check_identity(state, self.state_dict(), IDENTITY_KEYS, _STATE_VERSION)
        if not covers(state, self.slots):
            raise ConfigError(
                f"the saved data loader state holds sequence slots {state['slots']}, this rank serves "
                f"[{self.slots.start}, {self.slots.stop}): gather them from the saved ranks (hlat.data.slots.gather)"
            )
        self.windows = [int(n) for n in state["cursors"]]

    def stats(self) -> dict[str, float]:
        """Data metrics for the tracker.

        ``data/documents_consumed`` is an estimate: the tokens of this rank's consumed samples divided
        by the mean document length (tokens incl. EOS). ``data/epochs`` is the fraction of the stream
        consumed by all ranks together (the global batches this rank's slots are at, times
        ``global_batch_size`` samples of ``seq_len`` new tokens, over the tokens of one epoch).
        """
        tokens = sum(self.windows) * self.seq_len
        per_epoch = self.index.tokens_per_epoch
        global_tokens = tokens * self.global_batch_size / len(self.slots)
        return {
            "data/documents_consumed": float(tokens * self.num_documents / per_epoch),
            "data/skipped_documents": float(self.meta["skipped_rows"]),
            "data/tokens_produced": float(tokens),
            "data/padding_fraction": 0.0,
            "data/epochs": float(global_tokens / per_epoch),
        }

    def interval(self, device: torch.device) -> None:
        """Nothing to fetch from the device (one corpus)."""
        return None

    def run_info(self) -> dict[str, Any]:
        """Nothing to record beside the config (one corpus)."""
        return {}

    def close(self) -> None:
        """Nothing to release: the memmaps close with the object."""


def build_offline_loader(
    cfg: DataConfig,
    source: TextSource,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    global_batch_size: int | None = None,
) -> OfflinePackedLoader:
    """The ``data.loader=offline_packed`` loader of one rank: pre-tokenize (cached), then index.

    ``cfg.cache_dir`` and ``cfg.shuffle`` are used; the keyword arguments are as for
    :class:`OfflinePackedLoader` (``train.seq_len``, ``train.micro_batch_size``, ``train.seed``, DP layout).

    Raises:
        ConfigError: The data holds no documents or fewer tokens than one window of ``seq_len + 1``.
    """
    if seq_len <= 0 or micro_batch_size <= 0:
        raise ValueError(f"seq_len={seq_len} and micro_batch_size={micro_batch_size} must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
    where = f"data.path={source.path} (data.text_column={source.text_column!r})"
    chars = source.total_chars()
    if chars == 0:
        raise ConfigError(f"{where} holds no documents: every row is null or empty; point data.path at text")
    # Byte fallback bounds the tokens by bytes + one EOS per row: a cheap check before tokenizing.
    too_few = (
        f"fewer than one window of train.seq_len + 1 = {seq_len + 1} tokens; lower train.seq_len or point data.path "
        "at more data"
    )
    if chars + len(source) < seq_len + 1:
        raise ConfigError(f"{where} has only {chars} bytes of text, {too_few}")
    directory = pretokenize(source, tokenizer, cfg.cache_dir)
    meta = json.loads((directory / "meta.json").read_text())
    if meta["documents"] == 0:
        raise source.no_documents(f"each of the {meta['skipped_rows']} values")
    if meta["tokens"] < seq_len + 1:
        raise ConfigError(f"{where} tokenizes to {meta['tokens']} tokens, {too_few}")
    docs, tokens = meta["documents"], meta["tokens"]
    windows = f"{tokens // seq_len} windows of {seq_len + 1}"
    log.info("offline_packed data: %d documents, %d tokens (%s per epoch) from %s", docs, tokens, windows, directory)
    return OfflinePackedLoader(
        directory,
        tokenizer,
        source.fingerprint,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        seed=seed,
        shuffle=cfg.shuffle,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
