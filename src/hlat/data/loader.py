"""The training data stream: documents -> per-epoch shuffle -> DP shard -> lazy tokenization -> packing.

Each epoch visits every document once in a fresh order drawn from ``(seed, epoch)``; data-parallel
rank ``r`` of ``n`` reads every n-th document of that order starting at ``r``, so the ranks' streams
are disjoint and together cover the epoch. Documents are tokenized a few at a time, only when the
packer runs short, so startup does not wait for the whole corpus to be tokenized.

The loader's position is fully described by (epoch, documents read in this epoch, the packer's
leftover tokens); :meth:`PackedLoader.state_dict` saves exactly that, which is why a resumed loader
continues with the very batches an uninterrupted one would have produced.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hlat.config import ConfigError, DataConfig
from hlat.data.builtin import builtin_corpus_path
from hlat.data.packing import Packer
from hlat.data.sources import load_documents
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

_STATE_VERSION = 1
# One tokenizer call covers at most this many documents / characters: enough to keep
# sentencepiece's threads busy, small enough that the leftover tokens (saved in checkpoints) stay small.
ENCODE_MAX_DOCS = 64
ENCODE_MAX_CHARS = 1 << 18

# state_dict entries that must match on resume, and the setting a user would have changed.
_IDENTITY_KEYS = {
    "seed": "train.seed",
    "shuffle": "data.shuffle",
    "dp_rank": "the data-parallel rank",
    "dp_size": "the data-parallel size",
    "num_documents": "the data (data.path / data.text_column)",
    "tokenizer": "the tokenizer (data.tokenizer / model.vocab_size)",
}


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hashing decorrelates neighbouring (seed, epoch) pairs, which seed + epoch would not.
    digest = hashlib.blake2b(f"hlat-data|{seed}|{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _check_layout(seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if seq_len <= 0 or micro_batch_size <= 0:
        raise ValueError(f"seq_len={seq_len} and micro_batch_size={micro_batch_size} must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")


def _check_enough_documents(num_documents: int, dp_size: int) -> None:
    # A rank without documents could never fill a batch.
    if num_documents < dp_size:
        raise ConfigError(
            f"the data has {num_documents} documents, fewer than the {dp_size} data-parallel ranks; "
            "point data.path at more data or use fewer ranks"
        )


class PackedLoader:
    """Infinite iterator of packed ``(inputs, targets)`` micro-batches for one data-parallel rank.

    Args:
        documents: All documents of the corpus (every rank gets the same list).
        tokenizer: Tokenizer; its EOS separates documents.
        seq_len: Tokens per sequence.
        micro_batch_size: Sequences per batch.
        seed: Seed of the per-epoch document order.
        shuffle: Shuffle documents per epoch; False reads them in source order every epoch.
        dp_rank: This rank's index among the data-parallel ranks.
        dp_size: Number of data-parallel ranks.
        skipped_documents: Null/empty documents dropped by the reader (reported only).

    Attributes:
        tokenizer: The tokenizer.
        epoch: Current epoch (0-based) of this rank's stream.
        position: Documents of this rank's share of the current epoch already tokenized.
        documents_consumed: Documents tokenized and packed so far, over all epochs.
        tokens_produced: Target tokens emitted in batches so far (micro_batch_size * seq_len each).
        batches_produced: Batches emitted so far.
        skipped_documents: Null/empty documents the reader dropped.
    """

    def __init__(
        self,
        documents: Sequence[str],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        skipped_documents: int = 0,
    ) -> None:
        _check_layout(seq_len, micro_batch_size, dp_rank, dp_size)
        _check_enough_documents(len(documents), dp_size)
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.skipped_documents = skipped_documents
        self._packer = Packer(seq_len, tokenizer.eos_id)
        self.epoch = 0
        self.position = 0
        self.documents_consumed = 0
        self.tokens_produced = 0
        self.batches_produced = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) cache

    def epoch_document_order(self, epoch: int) -> list[int]:
        """Indices into ``documents`` that this rank reads in ``epoch``, in reading order."""
        order = list(range(len(self.documents)))
        if self.shuffle:
            # random.Random's integer seeding and shuffle are stable across Python versions and
            # platforms, so a checkpoint resumes with the same order elsewhere.
            random.Random(_epoch_seed(self.seed, epoch)).shuffle(order)
        return order[self.dp_rank :: self.dp_size]

    def _current_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_document_order(self.epoch))
        return self._order[1]

    def _feed(self) -> None:
        """Tokenize the next few documents of this rank's stream into the packer."""
        order = self._current_order()
        if self.position >= len(order):
            self.epoch += 1
            self.position = 0
            order = self._current_order()
        end, chars = self.position, 0
        while end < len(order) and end - self.position < ENCODE_MAX_DOCS and chars < ENCODE_MAX_CHARS:
            chars += len(self.documents[order[end]])
            end += 1
        texts = [self.documents[i] for i in order[self.position : end]]
        self._packer.add(self.tokenizer.encode(texts))
        self.documents_consumed += end - self.position
        self.position = end

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch.

        Returns:
            ``(inputs, targets)``, int64 tensors of shape ``(micro_batch_size, seq_len)``; row ``i`` of
            ``targets`` is row ``i`` of ``inputs`` shifted left by one token of the same packed window.
        """
        while self._packer.windows_ready() < self.micro_batch_size:
            self._feed()
        windows = torch.tensor([self._packer.pop() for _ in range(self.micro_batch_size)], dtype=torch.int64)
        self.batches_produced += 1
        self.tokens_produced += self.micro_batch_size * self.seq_len
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The stream position as plain Python values (JSON/pickle/torch.save friendly)."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_documents": len(self.documents),
            "tokenizer": self.tokenizer.fingerprint,
            "epoch": self.epoch,
            "position": self.position,
            "packer": self._packer.state_dict(),
            "documents_consumed": self.documents_consumed,
            "tokens_produced": self.tokens_produced,
            "batches_produced": self.batches_produced,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; later batches equal those of the saving loader.

        ``seq_len`` and ``micro_batch_size`` may differ from the saving loader's: the token stream
        is the same, only cut differently.

        Raises:
            ConfigError: The state comes from a different seed, shuffle setting, rank layout, corpus
                or tokenizer, so the stream could not continue where it stopped.
        """
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"data loader state has version {state.get('version')}, expected {_STATE_VERSION}")
        current = self.state_dict()
        diffs = [
            f"{what} was {state[key]!r} when the checkpoint was saved but is {current[key]!r} now"
            for key, what in _IDENTITY_KEYS.items()
            if state[key] != current[key]
        ]
        if diffs:
            raise ConfigError("cannot resume the data stream exactly: " + "; ".join(diffs))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._packer.load_state_dict(state["packer"])
        self.documents_consumed = int(state["documents_consumed"])
        self.tokens_produced = int(state["tokens_produced"])
        self.batches_produced = int(state["batches_produced"])


def build_loader(
    cfg: DataConfig,
    *,
    vocab_size: int,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> PackedLoader:
    """Build the data stream of one data-parallel rank from the ``data`` config.

    Cheap checks come first: a given tokenizer is loaded and checked against ``vocab_size`` before
    any data is read, and the data is validated before a tokenizer is trained.

    Args:
        cfg: The ``data`` config group.
        vocab_size: ``model.vocab_size``; the tokenizer must have exactly this many pieces.
        seq_len: ``train.seq_len``.
        micro_batch_size: ``train.micro_batch_size``.
        seed: ``train.seed``; fixes the document order of every epoch.
        dp_rank: This rank's data-parallel index.
        dp_size: Number of data-parallel ranks.

    Returns:
        The loader, positioned at the start of epoch 0.

    Raises:
        ConfigError: Bad path/column/tokenizer, vocabulary mismatch, or no documents at all.
    """
    _check_layout(seq_len, micro_batch_size, dp_rank, dp_size)
    cache_dir = Path(cfg.cache_dir).expanduser()
    tokenizer = load_tokenizer(cfg.tokenizer, vocab_size) if cfg.tokenizer is not None else None
    if cfg.path is None:
        source, column = builtin_corpus_path(cache_dir), "text"
    else:
        source, column = Path(cfg.path).expanduser(), cfg.text_column
    docs = load_documents(source, column)
    if not docs.texts:
        raise ConfigError(
            f"data.path={source} holds no documents: all {docs.skipped} values of data.text_column={column!r} "
            "are null or empty; point data.path / data.text_column at text"
        )
    _check_enough_documents(len(docs.texts), dp_size)
    if tokenizer is None:
        tokenizer = load_or_train_tokenizer(cfg, docs.texts, vocab_size, cache_dir)
    log.info(
        "data: %d documents from %s (%d empty skipped), tokenizer %s (%d pieces)",
        len(docs.texts),
        source,
        docs.skipped,
        tokenizer.path.name,
        tokenizer.vocab_size,
    )
    return PackedLoader(
        docs.texts,
        tokenizer,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        seed=seed,
        shuffle=cfg.shuffle,
        dp_rank=dp_rank,
        dp_size=dp_size,
        skipped_documents=docs.skipped,
    )
