"""A torch.distributed.checkpoint (DCP) save fed one tensor at a time from a reader, the next read while one is written.

``dcp.save`` plans over a state dict of meta placeholders; its file writer asks the planner for each tensor's data
in the plan's order (``resolve_data``). The planner here reads ahead on a thread of its own, within the largest
tensor's bytes, while DCP serializes and writes the last: about two tensors in memory, the reading and the writing
overlapped. The file system writes DCP's files past the page cache (``hlat.checkpoint.direct``) and hashes them as
they are written, so that the manifest's sha256s need no second pass over the files.
May import: ``hlat.config``, ``hlat.checkpoint.writer``, ``hlat.checkpoint.direct``, ``hlat.checkpoint.ranges``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from hlat.checkpoint import ranges
from hlat.checkpoint.direct import DirectFile, DirectIO
from hlat.checkpoint.writer import no_crc32


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's planner over meta placeholders: each tensor read from the source ahead of DCP asking for it.

    Reads run in the plan's order on a thread of their own, as far ahead as ``budget`` bytes allow (one tensor at
    least): small tensors are read well ahead, so that a big one after them does not find the writer waiting. DCP's
    file writer keeps a reference to every tensor it wrote until the file is closed, so the storage of the previous
    tensor is given up when the next one is asked for: memory holds the tensor being written and at most ``budget``
    bytes read ahead. A plan asked in another order than predicted only loses the overlap.
    """

    def __init__(self, read: Callable[[str], torch.Tensor], budget: int) -> None:
        super().__init__()
        self._read, self._budget = read, budget
        self._last: torch.Tensor | None = None
        self._order: list[str] = []
        self._bytes: dict[str, int] = {}
        self._next = 0  # the index in _order of the next read to start
        self._ahead: dict[str, Future] = {}
        self._ahead_bytes = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hlat-read")

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        # One file, one thread (write_torch): DCP writes the tensor items in the plan's order.
        items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO and i.tensor_data is not None]
        self._order = [i.index.fqn for i in items]
        self._bytes = {
            i.index.fqn: math.prod(i.tensor_data.size) * i.tensor_data.properties.dtype.itemsize  # type: ignore[union-attr]
            for i in items
        }
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        if self._last is not None:
            ranges.release(self._last)  # written already (the serial loader yields one at a time)
            self._last = None
        fqn = write_item.index.fqn
        done = self._ahead.pop(fqn, None)
        if done is not None:
            self._ahead_bytes -= self._bytes[fqn]
        elif fqn in self._bytes:
            self._next = max(self._next, self._order.index(fqn) + 1)  # asked before its turn: go on after it
        self._read_ahead()
        t = done.result() if done is not None else self._load(fqn)
        planned = self.lookup_object(write_item.index)
        if t.shape != planned.shape or t.dtype != planned.dtype:
            raise RuntimeError(
                f"{fqn}: read {tuple(t.shape)} {t.dtype}, planned {tuple(planned.shape)} {planned.dtype}"
            )
        self._last = t
        return t

    def _read_ahead(self) -> None:
        """Start the next reads in the plan's order while what is read ahead fits the budget."""
        while self._next < len(self._order):
            fqn = self._order[self._next]
            if self._ahead and self._ahead_bytes + self._bytes[fqn] > self._budget:
                return
            self._ahead[fqn] = self._pool.submit(self._load, fqn)
            self._ahead_bytes += self._bytes[fqn]
            self._next += 1

    def _load(self, fqn: str) -> torch.Tensor:
        t = self._read(fqn).contiguous()
        if ranges.is_mapped(t):
            return t  # a file's pages, given up once written (ranges.release)
        if t.untyped_storage().nbytes() != t.nbytes or not t.untyped_storage().resizable():
            t = ranges.empty(tuple(t.shape), t.dtype).copy_(t)  # a view into more, or not ours to free: a copy
        return t

    def close(self) -> None:
        """Wait for the reads still under way (an error in DCP's writing leaves some), and free what they read."""
        self._pool.shutdown(wait=True)
        for done in self._ahead.values():
            if done.exception() is None:
                ranges.release(done.result())
        self._ahead = {}


class _DirectFileSystem(FileSystem):
    """DCP's local file system, its files written through ``io`` and hashed on the way (``digests``: size, sha256).

    Each file is synced as it is closed: DCP's own ``fsync`` (``sync_files``) would come before the last block.
    """

    def __init__(self, io: DirectIO) -> None:
        super().__init__()
        self.io = io
        self.digests: dict[Path, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        out = DirectFile(Path(path), self.io)
        try:
            yield out
        except BaseException:
            out.abort()
            raise
        out.close()  # DCP closes it itself, before this: a second close does nothing
        self.digests[Path(path)] = (out.size, out.sha256())

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        if Path(path) in self.digests:
            self.digests[Path(new_path)] = self.digests.pop(Path(path))


def save(state: dict[str, Any], out: Path, read: Callable[[str], torch.Tensor]) -> dict[Path, tuple[int, str]]:
    """``dcp.save`` of ``state`` (meta placeholders) into ``out``, each tensor from ``read``; the files' digests.

    Raises:
        The reader's or the disk's error itself, not DCP's wrapper of it.
    """
    largest = max((t.nbytes for t in _tensors(state)), default=0)
    planner = _StreamingSavePlanner(read, largest)
    with warnings.catch_warnings(), DirectIO() as io:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        fs = _DirectFileSystem(io)
        writer = FileSystemWriter(out, thread_count=1, sync_files=False)  # each file synced as it closes
        writer.fs = fs  # DCP's writer keeps its file system here (torch.distributed.checkpoint.filesystem)
        try:
            with no_crc32():
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # the reader's or the disk's error, not DCP's wrapper (a BaseException)
            raise next(exc for exc, _ in e.failures.values()) from None
        finally:
            planner.close()
    return fs.digests


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested state dict."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _tensors(v)
