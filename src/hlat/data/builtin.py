"""The builtin corpus: real English text that ships with every CPython install, so a run needs no download.

About 1.7 MB of prose: the pydoc topic pages and the stdlib's docstrings, read with :mod:`ast` (never by importing,
so no side effects). Built once, in a few seconds, into a cached Arrow IPC file with one ``text`` column.
"""

from __future__ import annotations

import ast
import logging
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow as pa

log = logging.getLogger(__name__)

# Bump when the extraction rules change so that stale caches are not reused.
_FORMAT_VERSION = 1

# Short docstrings ("Return self.") are boilerplate, not prose; they would only teach the model
# one-liners and inflate the document count.
MIN_DOCSTRING_CHARS = 200

# Directories skipped while walking the stdlib: third-party code, tests (full of odd fixtures and
# intentionally broken files), the IDLE GUI, the deprecated lib2to3 grammar tests, and demo scripts.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}
)

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_sources(root: Path) -> list[Path]:
    """All stdlib ``.py`` files below ``root`` outside the skipped directories, in a stable order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped directories at all.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    # Sorting by the relative POSIX path makes the order independent of the filesystem and OS.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(path: Path) -> list[str]:
    """Docstrings of the module and every class/function in ``path`` (breadth-first, source order)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        # A stdlib file this interpreter cannot parse (or read) has nothing to offer; skip it.
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
    return out


PARTS = ("topics", "docstrings")
"""The builtin corpus's two parts, in its order: ``data.mix`` names them ``builtin:topics``, ``builtin:docstrings``."""


def collect_parts() -> dict[str, list[str]]:
    """The builtin corpus's documents by part (:data:`PARTS`), each in a deterministic order.

    ``topics``: the pydoc topics by name; ``docstrings``: the stdlib docstrings by path. Docstrings shorter than
    ``MIN_DOCSTRING_CHARS`` and exact duplicates (of any earlier document) are dropped.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # Some distributions strip pydoc_data; the docstrings alone still suffice.
        topics = {}
    parts: dict[str, list[str]] = {name: [] for name in PARTS}
    seen: set[str] = set()
    for key in sorted(topics):
        if topics[key] not in seen:  # some topics are aliases with the same text
            seen.add(topics[key])
            parts["topics"].append(topics[key])
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_sources(root):
        for doc in _docstrings(path):
            if len(doc) >= MIN_DOCSTRING_CHARS and doc not in seen:
                seen.add(doc)
                parts["docstrings"].append(doc)
    return parts


def collect_documents() -> list[str]:
    """The builtin corpus's documents, in a deterministic order: pydoc topics by name, then stdlib docstrings by path.

    Docstrings shorter than ``MIN_DOCSTRING_CHARS`` and exact duplicates are dropped.
    """
    return [doc for docs in collect_parts().values() for doc in docs]


def _cache_name(part: str | None = None) -> str:
    # The content is a function of the interpreter (its stdlib) and of the extraction rules, so the
    # name can be computed without building the corpus, which is what makes the cache check cheap.
    impl = sys.implementation.name
    return f"corpus-{impl}-{platform.python_version()}-v{_FORMAT_VERSION}{f'-{part}' if part else ''}.arrow"


def write_text_arrow(docs: list[str], path: Path) -> None:
    """Write ``docs`` as an Arrow IPC file with one ``text`` column, atomically (several ranks may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh, pa.ipc.new_file(fh, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def builtin_corpus_path(cache_dir: Path | str, part: str | None = None) -> Path:
    """Path of the builtin corpus (or one of its :data:`PARTS`) under ``<cache_dir>/builtin/``, built on first use.

    ``cache_dir`` is ``data.cache_dir``; the whole corpus is its parts one after the other.
    """
    assert part is None or part in PARTS, part
    path = Path(cache_dir).expanduser() / "builtin" / _cache_name(part)
    if path.is_file():
        return path
    log.info("building the builtin corpus from the Python %s standard library (one-off)", platform.python_version())
    start = time.perf_counter()
    if part is None:
        docs = collect_documents()
    else:  # both parts from one pass over the stdlib (a mixture of the builtin corpus reads both)
        parts = collect_parts()
        for name, part_docs in parts.items():
            if name != part:
                write_text_arrow(part_docs, path.with_name(_cache_name(name)))
        docs = parts[part]
    write_text_arrow(docs, path)
    size_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    log.info(
        "built the builtin corpus: %d documents, %.1f MB of text in %.1fs -> %s",
        len(docs),
        size_mb,
        time.perf_counter() - start,
        path,
    )
    return path
