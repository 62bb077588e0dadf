"""A torch.distributed.checkpoint (DCP) save fed one tensor at a time from a reader, the next read while one is written.

``dcp.save`` plans over a state dict of meta placeholders; its file writer asks the planner for each tensor's data
in the plan's order (``resolve_data``). The planner here reads the next one on a thread of its own while DCP
serializes and writes the last: two tensors in memory, the reading and the writing overlapped. The file system
hashes what DCP writes as it writes it, so that the manifest's sha256s need no second pass over the files.
May import: ``hlat.config``, ``hlat.checkpoint.writer``.
"""

from __future__ import annotations

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

from hlat.checkpoint.writer import Hashing, no_crc32


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's planner over meta placeholders: each tensor read from the source as DCP asks for it, the next ahead.

    DCP's file writer keeps a reference to every tensor it wrote until the file is closed, so the storage of the
    previous tensor is released when the next one is asked for: the one being written and the one read ahead are
    in memory. A plan asked in another order than predicted only loses the overlap.
    """

    def __init__(self, read: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._read = read
        self._last: torch.Tensor | None = None
        self._order: list[str] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hlat-read")
        self._ahead: tuple[str, Future] | None = None

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        # One file, one thread (write_torch): DCP writes the tensor items in the plan's order.
        self._order = [i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO]
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        if self._last is not None:
            self._last.untyped_storage().resize_(0)  # written already (the serial loader yields one at a time)
            self._last = None
        fqn = write_item.index.fqn
        ahead, self._ahead = self._ahead, None
        t = ahead[1].result() if ahead is not None and ahead[0] == fqn else self._load(fqn)
        if ahead is not None and ahead[0] != fqn:
            ahead[1].result().untyped_storage().resize_(0)  # asked out of order: that read was for nothing
        at = self._order.index(fqn) if fqn in self._order else len(self._order)
        if at + 1 < len(self._order):
            nxt = self._order[at + 1]
            self._ahead = (nxt, self._pool.submit(self._load, nxt))
        planned = self.lookup_object(write_item.index)
        if t.shape != planned.shape or t.dtype != planned.dtype:
            raise RuntimeError(
                f"{fqn}: read {tuple(t.shape)} {t.dtype}, planned {tuple(planned.shape)} {planned.dtype}"
            )
        self._last = t
        return t

    def _load(self, fqn: str) -> torch.Tensor:
        t = self._read(fqn).contiguous()
        if t.untyped_storage().nbytes() != t.nbytes or not t.untyped_storage().resizable():
            t = t.clone()  # a view into something bigger, or storage a reader cannot free: own a copy to free
        return t

    def close(self) -> None:
        """Wait for a read still under way (an error in DCP's writing leaves one)."""
        self._ahead = None
        self._pool.shutdown(wait=True)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes hashed on the way (``digests``: path -> size, sha256)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[Path, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            out = Hashing(stream)
            yield out
            self.digests[Path(path)] = (out.size, out.sha.hexdigest())

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        if Path(path) in self.digests:
            self.digests[Path(new_path)] = self.digests.pop(Path(path))


def save(state: dict[str, Any], out: Path, read: Callable[[str], torch.Tensor]) -> dict[Path, tuple[int, str]]:
    """``dcp.save`` of ``state`` (meta placeholders) into ``out``, each tensor from ``read``; the files' digests.

    Raises:
        The reader's or the disk's error itself, not DCP's wrapper of it.
    """
    planner = _StreamingSavePlanner(read)
    fs = _HashingFileSystem()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        writer = FileSystemWriter(out, thread_count=1, sync_files=True)
        writer.fs = fs  # DCP's writer keeps its file system here (torch.distributed.checkpoint.filesystem)
        try:
            with no_crc32():
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # the reader's or the disk's error, not DCP's wrapper (a BaseException)
            raise next(exc for exc, _ in e.failures.values()) from None
        finally:
            planner.close()
    return fs.digests
