"""Files written behind the caller's back: hashed as they are written, fsynced in batches, errors raised to the caller.

A conversion or a resharded resume reads and cuts the next tensor while this thread serializes the last into the
buffers of ``hlat.checkpoint.direct``, whose threads hash them and write them past the page cache, and another
waits for the disk (``fsync``): reading, converting, hashing, writing and syncing overlap (the copies, sha256 and
the writes release the GIL). The manifest's sha256s are
taken from the bytes as they go to the file, not read back. What waits in the queue is bounded in bytes, so the
memory a conversion holds stays about the tensor being cut plus that bound.
May import: ``hlat.config``, the core, ``hlat.checkpoint.direct``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, TypeVar

import torch

from hlat.checkpoint.direct import DirectFile, DirectIO

_STOP = object()


class Writer:
    """``save(obj, path)`` returns at once; the object is written on a thread of its own, in the order asked.

    Args:
        root: The directory written into (the directories made under it are synced too).
        limit_bytes: How many tensor bytes may wait to be written; ``save`` blocks beyond it (one item always fits).
        fsync: Make every file and directory durable before :meth:`close` returns (a resharded copy that is read
            once and removed needs none).
        digest: Take each file's sha256 as it is written (``digests``); without, ``digests`` records sizes alone.

    Use as a context manager: leaving the block waits for every write (:meth:`close`); an error on the writing
    thread is raised on the caller's thread at the next ``save`` or at ``close``.
    """

    def __init__(self, root: Path, limit_bytes: int, *, fsync: bool = True, digest: bool = True) -> None:
        self.root, self.limit, self.fsync, self.digest = Path(root), max(limit_bytes, 1), fsync, digest
        self.digests: dict[Path, tuple[int, str | None]] = {}
        """Every file written: its size and sha256 (None without ``digest``)."""
        self._queue: queue.Queue = queue.Queue()
        self._syncs: queue.Queue = queue.Queue(maxsize=64)  # open files waiting for fsync: a bound on descriptors
        self._held = threading.Condition()
        self._waiting = 0
        self._error: BaseException | None = None
        self._dirs: set[Path] = {self.root}
        self._io = DirectIO()
        self._threads = [
            threading.Thread(target=self._write, name="hlat-writer", daemon=True),
            threading.Thread(target=self._sync, name="hlat-fsync", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def save(self, obj: Any, path: Path, *, pickle_module: ModuleType | None = None) -> None:
        """Write ``obj`` with ``torch.save`` to ``path`` (its directory made); it must not change until written."""
        size = _tensor_bytes(obj)
        with self._held:
            while self._waiting and self._waiting + size > self.limit and self._error is None:
                self._held.wait()
            self._raise()
            self._waiting += size
        self._queue.put((obj, Path(path), pickle_module, size))

    def close(self) -> None:
        """Wait until everything is written (and, with ``fsync``, durable); raise the first error of the threads."""
        self._queue.put(_STOP)
        for t in self._threads:
            t.join()
        self._io.close()
        self._raise()
        if self.fsync:
            for d in sorted(self._dirs, key=lambda p: -len(p.parts)):  # the new entries of each directory
                fd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if err is None:
            self.close()
            return
        with self._held:  # the caller failed: stop writing, let the threads end, keep the caller's error
            self._error = self._error or err
        self._queue.put(_STOP)
        for t in self._threads:
            t.join()
        self._io.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _write(self) -> None:
        try:
            with no_crc32():
                self._write_all()
        except BaseException as e:  # raised on the caller's thread
            with self._held:
                self._error = self._error or e
                self._held.notify_all()
            while self._queue.get() is not _STOP:  # drain, so that no caller blocks on a full queue
                pass
        finally:
            self._syncs.put(None)

    def _write_all(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            obj, path, pickle_module, size = item
            if self._error is None:
                self._write_one(obj, path, pickle_module)
            del obj, item  # the tensor's memory goes before the next one is taken
            with self._held:
                self._waiting -= size
                self._held.notify_all()

    def _write_one(self, obj: Any, path: Path, pickle_module: ModuleType | None) -> None:
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs |= {d for d in (path.parent, *path.parent.parents) if self.root in d.parents}
        f = DirectFile(path, self._io, digest=self.digest, fsync=False)  # finished, synced, closed by the fsync thread
        try:
            torch.save(obj, f, **({"pickle_module": pickle_module} if pickle_module else {}))
            f.end()
        except BaseException:
            f.abort()
            raise
        self._syncs.put(f)

    def _sync(self) -> None:
        while (f := self._syncs.get()) is not None:
            try:
                if self._error is None:
                    f.finish()  # its last blocks and its tail, written and hashed
                    self.digests[f.path] = (f.size, f.sha256() if self.digest else None)
                    if self.fsync:
                        os.fsync(f.fileno())
            except BaseException as e:
                with self._held:
                    self._error = self._error or e
            finally:
                f.abort()  # closes it: finished, or left as it is after an error


def unmap_freed_tensors() -> None:
    """Have glibc give each freed buffer of 1 MiB or more back to the OS at once (no-op elsewhere).

    glibc raises its mmap threshold to the largest buffer freed (up to 32 MiB); the layer-sized tensors a conversion
    then reads and frees come from the heap, which fragments: converting 1.1B parameters to torch peaked at 3.2 GB
    of RSS for a 250 MiB largest tensor. A fixed threshold keeps every tensor its own mapping, unmapped when freed.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator is its own
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (malloc.h)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor ``obj`` (0 for anything else: pickles of references and shapes are small)."""
    return obj.untyped_storage().nbytes() if isinstance(obj, torch.Tensor) else 0


@contextlib.contextmanager
def no_crc32() -> Iterator[None]:
    """``torch.save`` on this thread without the CRC32 of its zip records while the block runs.

    Torch's option is per thread. ``torch.load`` does not check them (torch's ``set_crc32_options``), the
    manifest's sha256 covers every file, and they cost a CPU pass over every byte written. Torch before 2.6 has no
    such option: its saves are unchanged.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:
        yield
        return
    with config.patch({"save.compute_crc32": False}):
        yield


T = TypeVar("T")
_END = object()


def ahead(items: Iterable[T]) -> Iterator[T]:
    """``items`` in order, the next one made on a thread of its own while the caller works on the last.

    One item ahead: what the caller holds and the next one are in memory.
    """
    it = iter(items)
    with ThreadPoolExecutor(1, thread_name_prefix="hlat-ahead") as pool:
        coming = pool.submit(next, it, _END)
        while (item := coming.result()) is not _END:
            coming = pool.submit(next, it, _END)
            yield item  # type: ignore[misc]
