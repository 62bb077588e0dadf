"""Byte ranges of stored tensors: where ``torch.save`` put a tensor's bytes, read straight into a tensor's memory.

``torch.save`` writes a zip whose records are stored uncompressed: the bytes of a saved contiguous tensor are one
range of the file (xser writes one such file per tensor; DCP appends one such zip per tensor into its ``.distcp``
files). Found from the zip's directory alone, without unpickling anything, that range is read with ``preadv`` into
the destination: one copy, the kernel's; or mapped (:func:`mapped`): none. Whatever does not look so is left to the
caller's ordinary reader.
May import: ``hlat.config``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import mmap
import os
import re
import sys
import weakref
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

from hlat.config import ConfigError

_DATA = re.compile(r"[^/]+/data/\d+")
"""The name torch gives a storage's record in its zip (``<archive>/data/<key>``)."""


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file, as a file of their own (for ``zipfile``)."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) or 0
        self.pos += got
        return got


def data_offset(f: BinaryIO, nbytes: int, start: int = 0, length: int | None = None) -> int | None:
    """Where in file ``f`` the ``nbytes`` of the one storage of a ``torch.save`` zip start.

    The zip spans ``[start, start + length)`` of ``f`` (default: the whole file). None unless the zip holds exactly
    one storage record, uncompressed and exactly ``nbytes`` long: a caller then reads the tensor its usual way.
    """
    if length is None:
        length = os.fstat(f.fileno()).st_size - start
    try:
        with zipfile.ZipFile(_Window(f, start, length)) as z:
            data = [i for i in z.infolist() if _DATA.fullmatch(i.filename)]
    except (zipfile.BadZipFile, OSError, ValueError, KeyError):
        return None
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != nbytes:
        return None
    head = os.pread(f.fileno(), 30, start + data[0].header_offset)  # the local header, then its name and extra field
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return None
    name, extra = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    offset = data[0].header_offset + 30 + name + extra
    return start + offset if offset + nbytes <= length else None


def writable(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` (valid while ``t`` lives): a read into them fills the tensor.

    Through ctypes, not numpy: ``Tensor.numpy()`` marks the storage unresizable, and the writers free each tensor's
    storage as soon as it is written (``resize_(0)``).
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a byte view needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def pread_into(fd: int, into: memoryview, offset: int, where: Path) -> None:
    """Fill ``into`` from file descriptor ``fd`` at ``offset``; ConfigError naming ``where`` if the file ends first."""
    while len(into):
        n = os.preadv(fd, [into], offset)
        if n <= 0:
            raise ConfigError(f"{where} ends before its tensor's bytes do: it is truncated")
        into, offset = into[n:], offset + n


_MAPPED: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()
"""The mapping under each tensor :func:`mapped` returned, by its storage's address: what :func:`release` drops."""


def mapped(f: BinaryIO, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor whose bytes start at ``start`` of open file ``f``, mapped rather than read: no copy, no new memory.

    Reading into a new tensor costs the kernel's copy and, first, zeroing and mapping each page of fresh memory
    (0.55 CPU s per GB on the development VM, 0.12 into memory already used); a mapping reads the page cache in
    place, and copying from it cost 0.11 (``bench/write_paths.py``). Private (copy on write): the file never
    changes, whatever the caller does with the tensor. The mapping lives as long as the tensor (:func:`release`
    drops its pages earlier); the file must not be truncated meanwhile (a checkpoint is not: files are replaced,
    never rewritten in place).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    base = start - start % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(f.fileno(), start - base + nbytes, offset=base, access=mmap.ACCESS_COPY)
    with contextlib.suppress(AttributeError, OSError):  # a hint: read ahead of the faults
        m.madvise(mmap.MADV_SEQUENTIAL)
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start - base).view(dtype).reshape(shape)
    _MAPPED[t.untyped_storage().data_ptr()] = m
    return t


def is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a mapping :func:`mapped` made."""
    return t.untyped_storage().data_ptr() in _MAPPED


def release(t: torch.Tensor) -> None:
    """Give up the memory of ``t``, which nothing reads again: a mapped tensor's pages, another's storage.

    A reference kept elsewhere (DCP keeps every tensor it wrote until its file closes) no longer holds the memory.
    """
    storage = t.untyped_storage()
    m = _MAPPED.pop(storage.data_ptr(), None)
    if m is not None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            m.madvise(mmap.MADV_DONTNEED)
    elif storage.resizable():
        storage.resize_(0)


_HUGE = 2 << 20
_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` whose pages are asked to come as 2 MiB huge pages (``MADV_HUGEPAGE``) before first touch.

    New memory is zeroed and mapped a page at a time as it is first written: reading into it cost 0.55 CPU s per
    GB on the development VM with 4 KiB pages (the kernel's default for memory nobody advised, when it has no free
    huge page at hand), 0.22 with 2 MiB pages, 0.12 into memory already used (``bench/write_paths.py``). Where the
    kernel has no transparent huge pages, this is ``torch.empty``.
    """
    t = torch.empty(shape, dtype=dtype)
    if _madvise is not None and t.nbytes >= 2 * _HUGE:
        start = -(-t.data_ptr() // _HUGE) * _HUGE  # the whole huge pages inside this tensor's memory only
        end = (t.data_ptr() + t.nbytes) // _HUGE * _HUGE
        _madvise(start, end - start, 14)  # MADV_HUGEPAGE (linux/mman.h); a refusal leaves 4 KiB pages
    return t
