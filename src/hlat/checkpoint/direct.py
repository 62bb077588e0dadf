"""Files written past the page cache (``O_DIRECT``), from a few reused aligned buffers, on a thread of their own.

Why: a buffered write copies every byte into the page cache, into pages the kernel must first find and zero. On the
development VM that copy (``copy_folio_from_iter_atomic``) was 40% of a conversion's CPU samples; writing 4 GB
through the cache took 3.1 CPU s per GB at 300 MB/s, through this module 0.17 at 1,420 MB/s (0.87 with the sha256;
``bench/write_paths.py``). What hlat writes this way (a converted checkpoint, an export, a resharded copy) is written
once and read later, by another process if at all: caching it on the way out buys nothing.

How: :class:`DirectFile` copies what it is given into a buffer of :class:`DirectIO` (page-aligned, reused, so its
memory is never faulted in again) and hands each full buffer to DirectIO's threads, one writing it at its offset,
one adding it to the file's sha256 (files take turns between two such), while the caller fills the next. Hashing
apart keeps the caller to one copy per byte: sha256 (1.4 GB/s with SHA-NI) is the dearest step left. The
tail that does not fill a 4 KiB block is written through the cache at the end. Where the file system or device
refuses ``O_DIRECT`` (tmpfs before Linux 6.6, a device like ``/dev/full``, an alignment above 4 KiB, not Linux),
the same path writes through the cache: slower, never wrong.
May import: nothing of hlat.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

BLOCK = 8 << 20
"""Bytes of each buffer: one ``pwrite`` each (a multiple of every alignment ``O_DIRECT`` asks, 512 B to 4 KiB)."""
ALIGN = 4096
"""The file offsets and lengths ``O_DIRECT`` writes keep to; the tail below it goes through the cache."""
_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectIO:
    """The writing and hashing threads and the aligned buffers that the files (:class:`DirectFile`) of a job share.

    Args:
        depth: Buffers in all: one being filled, the others waiting for the threads or being written.
        hashers: Hashing threads; each file's blocks go to one of them, in turn.

    Use as a context manager (or call :meth:`close`): leaving it waits for every write handed to it.
    """

    def __init__(self, depth: int = 4, hashers: int = 2) -> None:
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(max(depth, 2)):
            self._free.put(mmap.mmap(-1, BLOCK))
        self._writing = ThreadPoolExecutor(1, thread_name_prefix="hlat-direct")  # sha256 and pwrite free the GIL
        # A file's blocks are hashed in order on one thread; the files of a job take turns, so that one file is
        # hashed while the last one's hash is finished (many small files: xser's).
        self._hashing = [ThreadPoolExecutor(1, thread_name_prefix="hlat-sha256") for _ in range(max(hashers, 1))]
        self._files = 0

    def lane(self) -> int:
        """The hashing thread of the next file."""
        self._files += 1
        return self._files % len(self._hashing)

    def take(self) -> mmap.mmap:
        """A free buffer (waits for a write to finish when all are in use)."""
        return self._free.get()

    def give_back(self, buf: mmap.mmap) -> None:
        """Return a buffer that was taken and not written."""
        self._free.put(buf)

    def write(self, fd: int, buf: mmap.mmap, length: int, offset: int, sha: Any = None, lane: int = 0) -> list[Future]:
        """Write ``buf[:length]`` to ``fd`` at ``offset``, and add it to ``sha`` on hashing thread ``lane``.

        The buffer is free again once both are done. A lane hashes blocks in the order they are handed over.
        """
        view = memoryview(buf)[:length]
        done = [self._writing.submit(_pwrite, fd, view, offset)]
        if sha is not None:
            done.append(self._hashing[lane].submit(sha.update, view))
        left, lock = [len(done)], threading.Lock()

        def release(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self._free.put(buf)

        for d in done:
            d.add_done_callback(release)
        return done

    def hash(self, sha: Any, data: bytes, lane: int = 0) -> Future:
        """Add ``data`` to ``sha`` after every block handed over to ``lane`` before it."""
        return self._hashing[lane].submit(sha.update, data)

    def close(self) -> None:
        """Wait for every write handed over."""
        self._writing.shutdown(wait=True)
        for lane in self._hashing:
            lane.shutdown(wait=True)

    def __enter__(self) -> DirectIO:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class DirectFile:
    """A new file written from start to end through a :class:`DirectIO`; its ``size`` and ``sha256`` as written.

    What ``torch.save``, ``pickle.dump`` and DCP's file writer ask of a stream: ``write``, ``flush``, ``tell``,
    ``fileno``, ``close``. ``flush`` writes nothing (a partial block cannot go out aligned); :meth:`finish` writes
    everything, :meth:`close` finishes, syncs (with ``fsync``) and closes; an error leaves through :meth:`abort`.

    Args:
        path: The file, created or truncated.
        io: The thread and buffers to write through.
        digest: Take the sha256 of the bytes (``sha256()``).
        fsync: Make the file durable in :meth:`close`.
    """

    def __init__(self, path: Path, io: DirectIO, *, digest: bool = True, fsync: bool = True) -> None:
        self.path, self.size, self._io, self._fsync = Path(path), 0, io, fsync
        self._sha = hashlib.sha256() if digest else None
        self._lane = io.lane()
        self._fd = _open(self.path)
        self._buf: mmap.mmap | None = None
        self._fill = 0
        self._offset = 0  # of the buffer being filled, in the file
        self._pending: list[Future] = []
        self._finished = self._closed = False
        self._tail = b""  # the bytes after the last 4 KiB block, written last

    def write(self, data: Any) -> int:
        """Take ``data`` (any contiguous buffer); a full buffer goes to the writing thread."""
        if self._finished:
            raise ValueError(f"{self.path}: written to after it was finished")
        view = memoryview(data).cast("B")
        n, at = len(view), 0
        while at < n:
            if self._buf is None:
                self._raise_finished()
                self._buf, self._fill = self._io.take(), 0
            k = min(n - at, BLOCK - self._fill)
            np.copyto(np.frombuffer(self._buf, np.uint8, k, self._fill), np.frombuffer(view, np.uint8, k, at))  # no GIL
            self._fill, at = self._fill + k, at + k
            if self._fill == BLOCK:
                self._send(BLOCK)
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing: ``torch.save`` flushes after every object, and a partial block cannot be written aligned."""

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self._fd

    def sha256(self) -> str:
        """The hex sha256 of everything written (``digest=True``); finishes the file first."""
        if self._sha is None:
            raise ValueError(f"{self.path} was written without a digest")
        self.finish()
        return self._sha.hexdigest()

    def end(self) -> None:
        """Hand every full 4 KiB block to the writing thread without waiting; nothing may be written after it."""
        if self._finished:
            return
        self._finished = True
        if self._buf is not None:
            aligned = self._fill - self._fill % ALIGN
            self._tail = bytes(memoryview(self._buf)[aligned : self._fill])  # under 4 KiB: copied out of the buffer
            if aligned:
                self._send(aligned)
            else:
                self._io.give_back(self._buf)
                self._buf = None
        if self._sha is not None and self._tail:
            self._pending.append(self._io.hash(self._sha, self._tail, self._lane))

    def finish(self) -> None:
        """Write what is left and wait until every byte is in the file (not yet durable); raise a write's error."""
        self.end()
        pending, self._pending = self._pending, []
        errors = [e for e in (done.exception() for done in pending) if e is not None]  # all waited for
        if errors:
            raise errors[0]
        tail, self._tail = self._tail, b""
        if tail:
            _set_direct(self._fd, False)  # an unaligned length: through the cache
            _pwrite(self._fd, memoryview(tail), self._offset)

    def close(self) -> None:
        """Finish, make the file durable (``fsync``) and close it; a second call does nothing."""
        if self._closed:
            return
        try:
            self.finish()
            if self._fsync:
                os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        os.close(self._fd)

    def abort(self) -> None:
        """Close after an error: wait for the writes under way (their errors dropped), keep the file as it is."""
        if self._closed:
            return
        self._finished = self._closed = True
        for done in self._pending:
            done.exception()  # the thread must be done with the descriptor before it is closed (and reused)
        if self._buf is not None:
            self._io.give_back(self._buf)
            self._buf = None
        os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if err is None:
            self.close()
        else:
            self.abort()

    def _send(self, length: int) -> None:
        assert self._buf is not None
        self._pending += self._io.write(self._fd, self._buf, length, self._offset, self._sha, self._lane)
        self._offset += length
        self._buf, self._fill = None, 0

    def _raise_finished(self) -> None:
        """Raise the error of a write that ended; forget the writes that are done."""
        for done in [d for d in self._pending if d.done()]:
            self._pending.remove(done)
            done.result()


def _open(path: Path) -> int:
    """``path`` opened for writing, created or truncated, with ``O_DIRECT`` where the file system takes it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT (tmpfs before Linux 6.6)
                raise
    return os.open(path, flags, 0o666)


def _set_direct(fd: int, on: bool) -> None:
    """Switch ``O_DIRECT`` on or off for the open file ``fd`` (nothing where there is none)."""
    if not _DIRECT:
        return
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | _DIRECT if on else flags & ~_DIRECT)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset``; where ``O_DIRECT`` refuses its alignment, the file goes on through the cache."""
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not _DIRECT or not fcntl.fcntl(fd, fcntl.F_GETFL) & _DIRECT:
                raise
            _set_direct(fd, False)  # the device wants a larger alignment than 4 KiB: write it through the cache
            continue
        view, offset = view[n:], offset + n
