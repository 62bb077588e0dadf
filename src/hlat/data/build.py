"""``build_loader``: one data-parallel rank's loader from the ``data`` config, cheapest checks first.

The online loader (``hlat.data.worker``, over ``hlat.data.loader``'s packed stream) or the offline baseline
(``hlat.data.offline``), chosen by ``data.loader``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from hlat.config import DataConfig
from hlat.data.builtin import builtin_corpus_path
from hlat.data.loader import StreamSpec, tokenizer_sample
from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer, load_or_train_tokenizer, load_tokenizer
from hlat.data.worker import OnlineLoader

log = logging.getLogger(__name__)


class Loader(Protocol):
    """One rank's resumable loader, as training uses it: an infinite iterator of ``(inputs, targets)`` batches."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def slots(self) -> range:
        """The sequence slots of the global batch this rank serves (``hlat.data.slots``)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position in the stream, as plain Python values (checkpointed)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpointed position."""
        ...

    def stats(self) -> dict[str, float]:
        """The ``data/*`` metrics of the interval."""
        ...

    def interval(self, device: torch.device) -> tuple[dict[str, torch.Tensor], Any] | None:
        """Device values to fetch with a log interval's, and the maker of their metrics (a mixture's); or None."""
        ...

    def run_info(self) -> dict[str, Any]:
        """Tags, params and files (name -> text) the run records of its data; empty for one corpus."""
        ...

    def close(self) -> None:
        """Stop the background worker, if any."""
        ...


def build_loader(
    cfg: DataConfig,
    *,
    vocab_size: int,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    global_batch_size: int | None = None,
    steps: int = 0,
) -> Loader:
    """Build one data-parallel rank's loader from the ``data`` config.

    The rank serves its share of the ``global_batch_size`` sequence slots (default: one micro-batch per rank), in
    micro-batches of ``micro_batch_size``; every global batch is the same whatever the layout. ``steps``
    (``train.steps``) is the horizon of a mixture's plan (its ``max_epochs`` checks); 0 plans nothing.

    Returns:
        The online loader, or the offline baseline for ``data.loader=offline_packed`` (see :class:`Loader`):
        ``(inputs, targets)`` int64 tensors of shape ``(micro_batch_size, seq_len)``.

    Raises:
        ConfigError: Bad path/column/tokenizer, vocabulary mismatch, or no documents.
    """
    global_batch_size = global_batch_size or micro_batch_size * dp_size
    _check_layout(seq_len, micro_batch_size, dp_rank, dp_size, global_batch_size)
    layout = (vocab_size, seq_len, micro_batch_size, seed, global_batch_size, dp_rank, dp_size)
    if cfg.mixed:
        return _build_mix(cfg, layout, steps)
    source, tokenizer = _open_data(cfg, vocab_size)
    if cfg.loader == "offline_packed":
        from hlat.data.offline import build_offline_loader

        return build_offline_loader(
            cfg,
            source,
            tokenizer,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    spec = StreamSpec(
        str(source.path),
        source.text_column,
        str(tokenizer.path),
        vocab_size,
        seq_len,
        micro_batch_size,
        seed,
        cfg.shuffle,
        global_batch_size,
        dp_rank,
        dp_size,
    )
    return OnlineLoader(spec, source, tokenizer, worker=cfg.worker, prefetch=cfg.prefetch)


def _build_mix(cfg: DataConfig, layout: tuple[int, ...], steps: int) -> Loader:
    """A mixture's loader (``data.mix``): its sources and tokenizer, its schedule, its plan checked before step 0."""
    from hlat.data.mix_loader import MixLoader
    from hlat.data.mix_plan import config_stages, mixture_sample, open_sources
    from hlat.data.mixture import MixSpec, SourceRef
    from hlat.data.schedule import Schedule

    vocab_size, seq_len, _, seed, global_batch_size, _, _ = layout
    cache_dir = Path(cfg.cache_dir).expanduser()
    tokenizer = load_tokenizer(cfg.tokenizer, vocab_size) if cfg.tokenizer is not None else None
    opened = open_sources(cfg)
    names, sources = tuple(opened), list(opened.values())
    if tokenizer is None:
        sample = mixture_sample(sources)
        if not sample:
            raise sources[0].no_documents("every value of every source")
        tokenizer = load_or_train_tokenizer(cfg, sample, vocab_size, cache_dir)
    stream = StreamSpec("", cfg.text_column, str(tokenizer.path), *layout[:4], cfg.shuffle, *layout[4:])
    refs = []
    for name, source in opened.items():
        cap = cfg.mix[name].max_epochs
        rows = int(cap * len(source)) if cap is not None else None
        refs.append(SourceRef(name, str(source.path), source.text_column, rows, f"data.mix.{name}.max_epochs"))
    stages = config_stages(cfg, steps, global_batch_size * seq_len)
    spec = MixSpec(stream, tuple(refs), Schedule(names, tuple(stages), global_batch_size, seed))
    log.info("data: a mix of %d sources (%d rows), tokenizer %s", len(names), sum(map(len, sources)), tokenizer.path)
    return MixLoader(
        spec,
        sources,
        tokenizer,
        stages,
        steps=steps,
        log_sources=cfg.log_sources,
        worker=cfg.worker,
        prefetch=cfg.prefetch,
    )


def _check_layout(seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int, global_batch_size: int) -> None:
    """Refuse a rank layout that no loader can serve (``hlat.parallel.ParallelDims`` words it for users)."""
    if (
        seq_len <= 0
        or micro_batch_size <= 0
        or not 0 <= dp_rank < dp_size
        or global_batch_size % (micro_batch_size * dp_size)
    ):
        raise ValueError(
            f"bad layout: seq_len={seq_len}, micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            f", global_batch_size={global_batch_size}"
        )


def _open_data(cfg: DataConfig, vocab_size: int) -> tuple[TextSource, Tokenizer]:
    """The documents and their tokenizer, cheapest checks first.

    A given tokenizer is checked against ``vocab_size`` before any data is read, and the data is validated
    before a tokenizer is trained.
    """
    cache_dir = Path(cfg.cache_dir).expanduser()
    tokenizer = load_tokenizer(cfg.tokenizer, vocab_size) if cfg.tokenizer is not None else None
    path, column = (builtin_corpus_path(cache_dir), "text") if cfg.path is None else (Path(cfg.path), cfg.text_column)
    source = TextSource(path, column, cache_dir)
    if tokenizer is None:
        tokenizer = _train_tokenizer(cfg, source, vocab_size, cache_dir)
    log.info(
        "data: %d rows from %s (%d files), tokenizer %s (%d pieces), loader %s",
        len(source),
        path,
        len(source.files),
        tokenizer.path.name,
        tokenizer.vocab_size,
        cfg.loader,
    )
    return source, tokenizer


def _train_tokenizer(cfg: DataConfig, source: TextSource, vocab_size: int, cache_dir: Path) -> Tokenizer:
    """The tokenizer ``data.tokenizer=null`` asks for: trained on a sample of ``source`` (or reused from the cache)."""
    sample = tokenizer_sample(source)
    if not sample:
        raise source.no_documents("every value")
    return load_or_train_tokenizer(cfg, sample, vocab_size, cache_dir)
