"""``hlat data prepare`` and ``hlat data tokenizer``: turn raw corpora into what ``data.path`` reads best.

:func:`prepare` streams JSONL, Parquet, Arrow IPC and text files into uncompressed Arrow IPC shards of one
``large_string`` column ``text``, which :class:`~hlat.data.sources.TextSource` memory-maps. Memory stays bounded by
one batch; an interrupted run leaves no shard behind. Imports ``hlat.config`` and ``hlat.data`` only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from hlat.config import ConfigError, DataConfig
from hlat.data.sources import ARROW_SUFFIXES, JSON_SUFFIXES, PARQUET_SUFFIXES, check_column, open_ipc
from hlat.data.tokenizer import Tokenizer, check_trainable_vocab, load_or_train_tokenizer

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt",)
INPUT_SUFFIXES = ARROW_SUFFIXES + PARQUET_SUFFIXES + JSON_SUFFIXES + TEXT_SUFFIXES
READ_BATCH_ROWS = 1024  # rows per read batch and per written record batch
WRITE_BATCH_BYTES = 64 << 20  # a record batch is also cut when its text reaches this size
_METADATA_FILES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})  # HF save_to_disk
_MISSING, _BAD_JSON = object(), object()  # row markers from the JSONL reader
SCHEMA = pa.schema([("text", pa.large_string())])


@dataclass
class PrepareReport:
    """What :func:`prepare` wrote: documents, skipped rows per reason, shards and sizes."""

    documents: int = 0
    skipped: Counter = field(default_factory=Counter)
    shards: list[Path] = field(default_factory=list)
    input_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """One line for the terminal."""
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        return (
            f"wrote {self.documents} documents to {len(self.shards)} shards ({self.output_bytes / 1e6:.1f} MB) "
            f"in {self.seconds:.1f}s ({self.input_bytes / 1e6 / max(self.seconds, 1e-9):.1f} MB/s of input); "
            f"skipped {sum(self.skipped.values())} rows ({why})"
        )


def input_files(inputs: Sequence[Path | str]) -> list[Path]:
    """The files behind ``inputs``, in order: files as given, directories searched recursively and sorted.

    Raises:
        ConfigError: An input does not exist, has an unsupported extension, or is a directory
            without any supported file.
    """
    fix = f"pass {'/'.join(INPUT_SUFFIXES)} files or directories of them as INPUT"
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ConfigError(f"INPUT {path} does not exist; {fix}")
        if path.is_file():
            if path.suffix.lower() not in INPUT_SUFFIXES:
                raise ConfigError(f"INPUT {path} has the unsupported extension {path.suffix!r}; {fix}")
            files.append(path)
            continue
        found = sorted(
            (
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in INPUT_SUFFIXES
                and p.name not in _METADATA_FILES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not found:
            raise ConfigError(f"INPUT {path} is a directory without any supported file; {fix}")
        files.extend(found)
    return files


def _clean(value: object) -> tuple[str | None, str | None]:
    """``(document, None)`` or ``(None, reason it is skipped)``."""
    if value is None or value is _MISSING:
        return None, "null"
    if value is _BAD_JSON:
        return None, "invalid JSON"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid UTF-8"
    elif not isinstance(value, str):
        return None, "not a string"
    else:
        try:  # JSON escapes can produce lone surrogates, which UTF-8 cannot encode
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None, "invalid UTF-8"
    if not value or value.isspace():
        return None, "blank"
    return value, None


def _values(array: pa.Array) -> list:
    # Bytes, decoded per value by _clean: a string column written without UTF-8 validation cannot break a batch.
    if pa.types.is_null(array.type):
        return [None] * len(array)
    return array.cast(pa.large_binary()).to_pylist()


def _read_jsonl(path: Path, column: str) -> Iterator[tuple[list, int]]:
    batch, nbytes, objects, keyed, first_keys = [], 0, 0, 0, None
    with open(path, "rb") as fh:
        for line in fh:
            nbytes += len(line)
            if not line.strip():
                continue  # blank lines between records are not rows
            try:  # surrogateescape keeps bad bytes apart: only a text value holding them is skipped
                obj = json.loads(line.decode("utf-8", "surrogateescape"))
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                objects += 1
                keyed += column in obj
                first_keys = list(obj) if first_keys is None else first_keys
                batch.append(obj.get(column, _MISSING))
            else:
                batch.append(_BAD_JSON)
            if len(batch) >= READ_BATCH_ROWS:
                yield batch, nbytes
                batch, nbytes = [], 0
    if objects and not keyed:
        raise ConfigError(
            f"--text-column={column!r} is not a key of any JSON object in {path} (the first has keys {first_keys}); "
            "pass --text-column with the key that holds the documents"
        )
    yield batch, nbytes


def _open_parquet(path: Path, column: str) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(
            f"INPUT {path} is not a Parquet file ({err}); if it holds JSON Lines or Arrow, give it that suffix "
            "(.jsonl, .arrow); if it is damaged, write it again"
        ) from err
    check_column(path, pf.schema_arrow, column, key="--text-column")
    return pf


def _open_arrow(path: Path, column: str) -> Iterator[pa.RecordBatch]:
    reader = open_ipc(path, key="INPUT")
    check_column(path, reader.schema, column, key="--text-column")
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def check_input(path: Path, column: str) -> None:
    """Fail early on a Parquet/Arrow file that cannot be read or lacks a string ``column``."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        _open_parquet(path, column).close()
    elif suffix in ARROW_SUFFIXES:
        _open_arrow(path, column)


def _read_parquet(path: Path, column: str) -> Iterator[tuple[list, int]]:
    pf = _open_parquet(path, column)
    per_row = path.stat().st_size / max(pf.metadata.num_rows, 1)
    for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=[column]):
        yield _values(batch.column(0)), int(per_row * batch.num_rows)


def _read_arrow(path: Path, column: str) -> Iterator[tuple[list, int]]:
    for batch in _open_arrow(path, column):
        array = batch.column(column)
        for lo in range(0, len(array), READ_BATCH_ROWS):
            chunk = array.slice(lo, READ_BATCH_ROWS)
            yield _values(chunk), chunk.nbytes


def _read_text(path: Path, lines: bool) -> Iterator[tuple[list, int]]:
    if not lines:  # the whole file is one document
        data = path.read_bytes()
        yield [data], len(data)
        return
    batch, nbytes = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            nbytes += len(line)
            if line.strip():  # blank lines separate documents; they are not rows
                batch.append(line.rstrip(b"\r\n"))
            if len(batch) >= READ_BATCH_ROWS:
                yield batch, nbytes
                batch, nbytes = [], 0
    yield batch, nbytes


def _read(path: Path, column: str, lines: bool) -> Iterator[tuple[list, int]]:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _read_jsonl(path, column)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path, column)
    if suffix in ARROW_SUFFIXES:
        return _read_arrow(path, column)
    return _read_text(path, lines)


class _ShardWriter:
    """Writes ``shard-NNNNN.arrow`` files of at most ``shard_rows`` rows, one record batch at a time."""

    def __init__(self, directory: Path, shard_rows: int) -> None:
        self.directory, self.shard_rows = directory, shard_rows
        self.paths: list[Path] = []
        self._pending: list[str] = []
        self._pending_bytes = self._rows = 0
        self._writer: pa.ipc.RecordBatchFileWriter | None = None

    def add(self, doc: str) -> None:
        self._pending.append(doc)
        self._pending_bytes += len(doc)
        if (
            len(self._pending) >= READ_BATCH_ROWS
            or self._pending_bytes >= WRITE_BATCH_BYTES
            or self._rows + len(self._pending) >= self.shard_rows
        ):
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._writer is None:
            self.paths.append(self.directory / f"shard-{len(self.paths):05d}.arrow")
            self._writer = pa.ipc.new_file(str(self.paths[-1]), SCHEMA)
        self._writer.write_batch(pa.record_batch([pa.array(self._pending, pa.large_string())], schema=SCHEMA))
        self._rows += len(self._pending)
        self._pending, self._pending_bytes = [], 0
        if self._rows >= self.shard_rows:
            self._writer.close()
            self._writer, self._rows = None, 0

    def close(self) -> list[Path]:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self.paths


def prepare(
    inputs: Sequence[Path | str],
    output: Path | str,
    *,
    text_column: str = "text",
    shard_rows: int = 100_000,
    lines: bool = False,
    progress: bool = True,
) -> PrepareReport:
    """Convert ``inputs`` into Arrow IPC shards in ``output``.

    Rows that are null, blank, not strings or not valid UTF-8 are counted per reason and skipped.

    Args:
        inputs: Files or directories (``.jsonl``/``.json``, ``.parquet``, ``.arrow``/``.feather``/``.ipc``, ``.txt``).
        output: Directory for ``shard-00000.arrow``, ...; created if missing; must not hold shards yet.
        text_column: Column / JSON key of the documents (ignored for ``.txt``).
        shard_rows: Documents per shard.
        lines: ``.txt`` files hold one document per non-blank line instead of one per file.
        progress: Show a tqdm bar over the input bytes.

    Raises:
        ConfigError: Missing or unreadable inputs, a wrong ``--text-column``, an ``--output`` that
            already holds shards, or no document at all.
    """
    if shard_rows <= 0:
        raise ConfigError(f"--shard-rows={shard_rows} must be >= 1 (documents per shard); e.g. --shard-rows=100000")
    start, out = time.perf_counter(), Path(output).expanduser()
    files = input_files(inputs)
    for path in files:
        check_input(path, text_column)
    if out.is_file() or (out.is_dir() and any(out.glob("shard-*.arrow"))):
        raise ConfigError(f"--output {out} is a file or already holds shard-*.arrow files; pass a new directory")
    out.mkdir(parents=True, exist_ok=True)
    # Shards are written to a hidden directory and moved into place at the end: an interrupted run leaves nothing
    # that data.path would read.
    partial = Path(tempfile.mkdtemp(dir=out, prefix=".partial-"))
    report = PrepareReport(input_bytes=sum(f.stat().st_size for f in files))
    writer = _ShardWriter(partial, shard_rows)
    try:
        _write_documents(files, writer, report, text_column=text_column, lines=lines, progress=progress)
        writer.close()
        if report.documents == 0:
            raise ConfigError(
                f"the inputs hold no documents: all {sum(report.skipped.values())} rows were skipped "
                f"({dict(report.skipped)}); check INPUT and --text-column"
            )
        for shard in writer.paths:
            os.replace(shard, out / shard.name)
            report.shards.append(out / shard.name)
    finally:
        writer.close()
        shutil.rmtree(partial, ignore_errors=True)
    report.output_bytes = sum(p.stat().st_size for p in report.shards)
    report.seconds = time.perf_counter() - start
    if report.skipped:
        log.warning("skipped %d rows: %s", sum(report.skipped.values()), dict(report.skipped))
    return report


def _write_documents(
    files: list[Path], writer: _ShardWriter, report: PrepareReport, *, text_column: str, lines: bool, progress: bool
) -> None:
    """Stream every row of ``files`` into ``writer``, counting documents and skipped rows (per reason) in ``report``."""
    with tqdm(
        total=report.input_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress, leave=False
    ) as bar:
        for path in files:
            done = 0
            for values, nbytes in _read(path, text_column, lines):
                for value in values:
                    doc, reason = _clean(value)
                    if doc is None:
                        report.skipped[reason] += 1
                    else:
                        writer.add(doc)
                        report.documents += 1
                nbytes = min(nbytes, path.stat().st_size - done)  # the reader's byte counts are estimates
                done += nbytes
                bar.update(nbytes)
            bar.update(path.stat().st_size - done)


def train_tokenizer(
    data: Path | str,
    output: Path | str,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    text_column: str = "text",
    cache_dir: Path | str = DataConfig.cache_dir,
) -> Tokenizer:
    """Train a sentencepiece model on ``data`` with the project's recipe and copy it to ``output``.

    It trains on the same bounded, evenly strided sample of the rows as a run with ``data.tokenizer=null``
    does, and through the same cache (``<cache_dir>/tokenizers/``), so such a run on the same data and
    ``data.cache_dir`` reuses it, and ``data.tokenizer=<output>`` gives the same ids.

    Raises:
        ConfigError: Unreadable data, a wrong column, or a vocabulary the data cannot fill.
    """
    from hlat.data.loader import tokenizer_sample  # the run's sample: same cache key, bounded memory
    from hlat.data.sources import TextSource

    check_trainable_vocab(vocab_size)  # before any data is read
    cfg = DataConfig(
        path=str(data), text_column=text_column, tokenizer=None, tokenizer_type=model_type, cache_dir=str(cache_dir)
    )
    source = TextSource(data, text_column)
    sample = tokenizer_sample(source)
    if not sample:
        raise source.no_documents("every value")
    tok = load_or_train_tokenizer(cfg, sample, vocab_size, cache_dir)
    out = Path(output).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.copyfile(tok.path, tmp)
    os.replace(tmp, out)
    return Tokenizer(out)
