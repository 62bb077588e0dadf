"""Read training documents from Arrow IPC, Parquet or JSONL files (or a directory of them).

What a user can get wrong about the data (the path, the column, its type) is refused here, before any tokenizer
or model is built, with a :class:`~hlat.config.ConfigError` naming the ``data.*`` key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from hlat.config import ConfigError
from hlat.data.identity import data_fingerprint

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")
SUPPORTED_SUFFIXES = ARROW_SUFFIXES + PARQUET_SUFFIXES + JSON_SUFFIXES

# Metadata files that Hugging Face ``datasets.save_to_disk`` puts next to its ``.arrow`` shards; they
# are JSON but not documents, and reading them would fail the text-column check.
_METADATA_FILES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})

_FIX_TEXT = "point data.path / data.text_column at text"
_FIX_PATH = (
    "point data.path at an Arrow (.arrow/.feather/.ipc), Parquet (.parquet) or JSONL (.jsonl/.json) file or directory"
)


@dataclass
class Documents:
    """Documents read from a source: the non-empty ones in file order, how many were skipped, the files read."""

    texts: list[str]
    skipped: int = 0
    files: list[Path] = field(default_factory=list)


def resolve_files(path: Path | str) -> list[Path]:
    """The data files behind ``data.path``: the file itself, or a directory's supported files, sorted by path.

    In a directory, hidden, metadata and unsupported files (a README) are ignored.

    Raises:
        ConfigError: The path does not exist, is a file of an unsupported extension, or is a directory without
            any supported file.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"data.path={path} does not exist; {_FIX_PATH}")
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise ConfigError(
                f"data.path={path} has the unsupported extension {path.suffix!r} "
                f"(supported: {', '.join(SUPPORTED_SUFFIXES)}); {_FIX_PATH}"
            )
        return [path]
    files = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUPPORTED_SUFFIXES
        and p.name not in _METADATA_FILES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise ConfigError(
            f"data.path={path} is a directory without any {'/'.join(SUPPORTED_SUFFIXES)} file; {_FIX_PATH}"
        )
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def open_ipc(path: Path, key: str = "data.path") -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
    """Open a memory-mapped Arrow IPC file (pyarrow, polars) or stream (HF datasets); else a ConfigError on ``key``."""
    try:
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_file(source)
        except (pa.ArrowInvalid, OSError):  # not the file format: try the stream format
            source.seek(0)
            return pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError) as err:  # garbage reads as OSError ("Invalid IPC stream"), empty as invalid
        fix = (
            "; if it holds Parquet or JSON Lines, give it that suffix (.parquet, .jsonl); if it is damaged, write "
            f"it again (e.g. `hlat data prepare`); or {_FIX_PATH}"
            if key == "data.path"
            else ""
        )
        raise ConfigError(
            f"{key}: {path} is not an Arrow IPC file or stream ({err}), which its {path.suffix!r} "
            f"suffix promises (Arrow's file or stream format, as pyarrow, polars, HF datasets or "
            f"`hlat data prepare` write it){fix}"
        ) from err


def _read_arrow(path: Path, text_column: str) -> pa.Table:
    # Memory-mapped and zero-copy: the table's buffers point into the page cache, so a corpus larger
    # than RAM costs address space, not memory.
    reader = open_ipc(path)
    check_column(path, reader.schema, text_column)
    try:
        return reader.read_all().select([text_column])
    except (pa.ArrowInvalid, OSError) as err:  # a valid header, then garbage: a truncated or damaged file
        raise ConfigError(
            f"data.path: {path} is a damaged Arrow IPC file ({err}); write it again (e.g. with "
            f"`hlat data prepare`) or {_FIX_PATH}"
        ) from err


def _read_parquet(path: Path, text_column: str) -> pa.Table:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"data.path: {path} is not a Parquet file ({err}); {_FIX_PATH}") from err
    check_column(path, schema, text_column)
    # Parquet is compressed, so it is decoded into memory; `hlat data prepare` converts a corpus larger
    # than RAM into memory-mappable Arrow IPC. Only the text column is read.
    return pq.read_table(path, columns=[text_column])


def _read_jsonl(path: Path, text_column: str) -> pa.Table:
    try:
        table = pajson.read_json(path)
    except pa.ArrowInvalid as err:
        with open(path, "rb") as fh:
            head = fh.read(64)
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head:  # a byte-order mark, or NUL bytes
            raise ConfigError(
                f"data.path: {path} is UTF-16 text, not the UTF-8 that JSON Lines is: re-encode it, e.g. "
                f"`iconv -f utf-16 -t utf-8 {path} > {path.with_name(f'{path.stem}.utf8{path.suffix}')}`, and "
                "point data.path at the result"
            ) from err
        raise ConfigError(
            f"data.path: {path} could not be read as JSON Lines ({err}); a .json/.jsonl file must hold one "
            f"JSON object per line with the documents under the key data.text_column={text_column!r}: fix the "
            "file, or convert it with `hlat data prepare`, which skips the lines that are not JSON"
        ) from err
    check_column(path, table.schema, text_column)
    return table.select([text_column])


def _is_text_type(t: pa.DataType) -> bool:
    # An all-null JSON key is inferred as the null type: valid, just nothing but skipped documents.
    # Binary columns are accepted: rows that are not valid UTF-8 are counted and skipped when read.
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_null(t)
    )


def check_column(path: Path, schema: pa.Schema, text_column: str, key: str = "data.text_column") -> None:
    """Raise a ConfigError naming ``key`` unless ``schema`` has ``text_column`` of a text or binary type."""
    if text_column not in schema.names:
        raise ConfigError(
            f"{key}={text_column!r} is not a column of {path}; its columns are {schema.names}; "
            f"set {key} to the one that holds the documents"
        )
    t = schema.field(text_column).type
    if not _is_text_type(t):
        raise ConfigError(
            f"{key}={text_column!r} in {path} has type {t}, not string or binary; "
            f"set {key} to a string column holding the documents"
        )


def read_text_column(path: Path, text_column: str) -> pa.ChunkedArray:
    """The text column (``data.text_column``) of one data file, nulls and empty strings included.

    Raises:
        ConfigError: The file cannot be parsed, lacks the column, or the column is not a string.
    """
    suffix = path.suffix.lower()
    if suffix in ARROW_SUFFIXES:
        table = _read_arrow(path, text_column)
    elif suffix in PARQUET_SUFFIXES:
        table = _read_parquet(path, text_column)
    elif suffix in JSON_SUFFIXES:
        table = _read_jsonl(path, text_column)
    else:  # resolve_files filters these out; kept for direct callers.
        raise ConfigError(f"data.path: {path} has the unsupported extension {suffix!r}; {_FIX_PATH}")
    return table.column(text_column)


def _decode(values: list) -> list[str | None]:
    """Python strings from string or binary values; None for null, blank, or not valid UTF-8."""
    out: list[str | None] = []
    for v in values:
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                v = None
        # Whitespace-only documents carry no text to learn from; they would only add EOS tokens.
        out.append(v if v is not None and not v.isspace() and v else None)
    return out


class TextSource:
    """Random access to the documents of one or more files, by global row index (files in path order).

    Arrow IPC is memory-mapped; Parquet and JSONL are decoded into memory. Rows that are null, blank or not valid
    UTF-8 read as None (the loader counts and skips them). ``cache_dir`` (``data.cache_dir``) caches the file digests
    of :attr:`fingerprint`; None digests without a cache.

    Raises:
        ConfigError: See :func:`resolve_files` and :func:`read_text_column`; or every row is null.
    """

    def __init__(self, path: Path | str, text_column: str = "text", cache_dir: Path | str | None = None) -> None:
        self.path = Path(path).expanduser()
        self.text_column = text_column
        self.cache_dir = cache_dir
        self.files = resolve_files(self.path)
        chunks = [read_text_column(f, text_column) for f in self.files]
        self._binary = any(pa.types.is_binary(c.type) or pa.types.is_large_binary(c.type) for c in chunks)
        # One logical column over all files; string and large_string (or binary) must agree to concatenate.
        target = pa.large_binary() if self._binary else pa.large_string()
        self.column = pa.chunked_array([a for c in chunks for a in c.cast(target).chunks], type=target)
        # Row -> chunk lookup: `take` on a many-chunk column rebuilds it on every call (~5 ms for 43 chunks).
        self._chunk_starts = np.cumsum([0] + [len(c) for c in self.column.chunks])
        self._file_starts = np.cumsum([0] + [len(c) for c in chunks])  # row -> file, for messages
        if len(self.column) == self.column.null_count:
            raise ConfigError(
                f"data.path={self.path} holds no documents: all {len(self.column)} values of "
                f"data.text_column={text_column!r} are null; point data.path / data.text_column at text"
            )

    def __len__(self) -> int:
        return len(self.column)

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the data for resume checks: rows, and each file's name, size and content digest.

        See :mod:`hlat.data.identity`; computed on first use (it reads the files that are not in the cache).
        """
        directory = self.path.is_dir()
        names = {f.relative_to(self.path).as_posix() if directory else f.name: f for f in self.files}
        return data_fingerprint(len(self), names, self.cache_dir)

    def get(self, rows: np.ndarray | list[int]) -> list[str | None]:
        """The documents at ``rows`` (global indices), in that order; None for skipped rows."""
        rows = np.asarray(rows, dtype=np.int64)
        chunk_of = np.searchsorted(self._chunk_starts, rows, side="right") - 1
        values: list = [None] * len(rows)
        for chunk in np.unique(chunk_of):
            at = np.flatnonzero(chunk_of == chunk)
            taken = self.column.chunk(int(chunk)).take(pa.array(rows[at] - self._chunk_starts[chunk]))
            try:
                got = taken.to_pylist()
            except UnicodeDecodeError:  # a string column written without UTF-8 validation
                got = taken.cast(pa.large_binary()).to_pylist()
            for i, v in zip(at.tolist(), got, strict=True):
                values[i] = v
        return _decode(values)

    def iter_rows(self, start: int = 0, batch_rows: int = 1024):
        """Sequential scan from ``start``: yields lists of documents (None for skipped rows)."""
        for lo in range(start, len(self), batch_rows):
            yield self.get(range(lo, min(lo + batch_rows, len(self))))

    def no_documents(self, what: str) -> ConfigError:
        """The error for data that yields no document: ``what`` (``every value``...) is null, blank or not UTF-8.

        It names the first value that is not UTF-8, if any, and how to re-encode its file.
        """
        where = f"data.path={self.path} holds no documents: {what} of data.text_column={self.text_column!r}"
        return ConfigError(f"{where} is null, blank or not UTF-8; {self.encoding_problem() or _FIX_TEXT}")

    def encoding_problem(self) -> str | None:
        """The first value that is not valid UTF-8 and how to re-encode its file; None if every value is UTF-8."""
        row = self._first_not_utf8()
        if row is None:
            return None
        i = int(np.searchsorted(self._file_starts, row, side="right")) - 1
        path, in_file = self.files[i], row - int(self._file_starts[i])
        if path.suffix.lower() not in JSON_SUFFIXES:
            return (
                f"row {in_file} of {path} is not UTF-8: write data.text_column as UTF-8 text (decode the values "
                "from their encoding first), or point data.path at UTF-8 data"
            )
        at = _first_bad_line(path)
        where = f"line {at[0]} of {path} (byte offset {at[1]})" if at else f"row {in_file} of {path}"
        utf8 = path.with_name(f"{path.stem}.utf8{path.suffix}")
        return (
            f"{where} is not UTF-8: re-encode the file to UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > "
            f"{utf8}` for Latin-1 text, and point data.path at the result"
        )

    def _first_not_utf8(self) -> int | None:
        for start, chunk in zip(self._chunk_starts.tolist(), self.column.chunks, strict=False):
            raw = chunk.cast(pa.large_binary())
            try:
                raw.cast(pa.large_string())  # validates UTF-8 in C: the Python scan below runs on one chunk only
                continue
            except pa.ArrowInvalid:
                pass
            for j, value in enumerate(raw.to_pylist()):
                try:
                    if value is not None:
                        value.decode("utf-8")
                except UnicodeDecodeError:
                    return start + j
        return None

    def total_chars(self) -> int:
        """Total bytes of text (cheap: Arrow keeps value offsets)."""
        return int(pc.sum(pc.binary_length(self.column)).as_py() or 0)


def _first_bad_line(path: Path) -> tuple[int, int] | None:
    """``(line number, byte offset)`` of the first bytes of ``path`` that are not UTF-8; None if there are none."""
    offset = 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return number, offset + e.start
            offset += len(line)
    return None


def load_documents(path: Path | str, text_column: str = "text") -> Documents:
    """Read every non-empty document under ``path`` into memory (small corpora, tests, tools).

    Raises:
        ConfigError: See :func:`resolve_files` and :func:`read_text_column`.
    """
    source = TextSource(path, text_column)
    texts: list[str] = []
    skipped = 0
    for batch in source.iter_rows():
        for doc in batch:
            if doc is None:
                skipped += 1
            else:
                texts.append(doc)
    return Documents(texts=texts, skipped=skipped, files=source.files)
