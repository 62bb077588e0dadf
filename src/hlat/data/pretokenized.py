"""The offline loader's cache: a corpus tokenized once into ``<data.cache_dir>/offline/<key>/``.

``tokens.bin`` (each document's ids + EOS; uint16, uint32 from 65536 pieces), ``doc_offsets.npy`` (int64,
documents + 1) and ``meta.json`` (counts), keyed by a hash of data and tokenizer; ``hlat.data.offline`` reads it
back with ``np.memmap``. Imports ``hlat.data`` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hlat.data.sources import TextSource
from hlat.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1  # bump when the cache layout changes: it is part of the cache key
ENCODE_BATCH_ROWS = 1024  # documents per tokenizer call while pre-tokenizing


def token_dtype(vocab_size: int) -> np.dtype:
    """Storage dtype of ``tokens.bin``: uint16 below 65536 pieces, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def cache_key(source: TextSource, tokenizer: Tokenizer) -> str:
    """Hash of the data (fingerprint, resolved paths, mtimes, column) and the tokenizer."""
    files = "|".join(f"{f.resolve()}:{f.stat().st_mtime_ns}" for f in source.files)
    text = f"hlat-offline-v{_FORMAT_VERSION}|{source.fingerprint}|{files}|{source.text_column}|{tokenizer.fingerprint}"
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock so that ranks sharing a node tokenize once, not once each."""
    try:
        import fcntl
    except ImportError:  # Not POSIX: concurrent builders still end in one complete cache (atomic rename).
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tokenize_into(out: Path, source: TextSource, tokenizer: Tokenizer, progress: bool) -> dict[str, Any]:
    dtype, eos = token_dtype(tokenizer.vocab_size), (tokenizer.eos_id,)
    documents = skipped = tokens = 0
    start = time.perf_counter()
    raw_offsets = out / "doc_offsets.raw"
    with (
        open(out / "tokens.bin", "wb") as tok_fh,
        open(raw_offsets, "wb") as off_fh,
        tqdm(total=len(source), unit="doc", desc="pre-tokenizing", disable=not progress, mininterval=1.0) as bar,
    ):
        off_fh.write(np.zeros(1, np.int64).tobytes())
        for batch in source.iter_rows(batch_rows=ENCODE_BATCH_ROWS):
            texts = [t for t in batch if t is not None]
            skipped += len(batch) - len(texts)
            if texts:
                ids = tokenizer.encode(texts)
                lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
                ends = tokens + np.cumsum(lengths)
                flat = itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids)
                tok_fh.write(np.fromiter(flat, dtype=dtype, count=int(ends[-1] - tokens)).tobytes())
                off_fh.write(ends.tobytes())
                documents, tokens = documents + len(texts), int(ends[-1])
            bar.update(len(batch))
    # Convert the raw offsets to .npy through memmaps: no step holds all of them in memory.
    src = np.memmap(raw_offsets, dtype=np.int64, mode="r")
    dst = np.lib.format.open_memmap(out / "doc_offsets.npy", mode="w+", dtype=np.int64, shape=src.shape)
    dst[:] = src
    dst.flush()
    del src, dst
    raw_offsets.unlink()
    meta = {
        "version": _FORMAT_VERSION,
        "documents": documents,
        "skipped_rows": skipped,
        "tokens": tokens,
        "rows": len(source),
        "dtype": dtype.name,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "data": source.fingerprint,
        "tokenizer": tokenizer.fingerprint,
        "seconds": round(time.perf_counter() - start, 3),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def pretokenize(source: TextSource, tokenizer: Tokenizer, cache_dir: Path | str, *, progress: bool = True) -> Path:
    """Tokenize ``source`` into ``<cache_dir>/offline/<key>/`` unless that is already there.

    The cache is built in a hidden temporary directory and renamed into place, so a crash never leaves
    a half-written cache behind; an advisory file lock keeps concurrent ranks from building it twice.

    Returns:
        The cache directory (``tokens.bin``, ``doc_offsets.npy``, ``meta.json``).
    """
    root = Path(cache_dir).expanduser() / "offline"
    out = root / cache_key(source, tokenizer)
    if (out / "meta.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{out.name}.lock"):
        if (out / "meta.json").is_file():  # another rank built it while this one waited
            return out
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            meta = _tokenize_into(tmp, source, tokenizer, progress)
            if out.exists():  # an incomplete cache from an interrupted manual copy; meta.json is missing
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    mb = meta["tokens"] * token_dtype(tokenizer.vocab_size).itemsize / 1e6
    log.info(
        "pre-tokenized %d documents (%d skipped) into %d tokens (%.1f MB) in %.1fs (%.0f tokens/s) -> %s",
        meta["documents"],
        meta["skipped_rows"],
        meta["tokens"],
        mb,
        meta["seconds"],
        meta["tokens"] / max(meta["seconds"], 1e-9),
        out,
    )
    return out
