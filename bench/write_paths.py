"""What a conversion's bytes cost on their way through memory: the figures behind ``checkpoint.direct`` and ``ranges``.

    python bench/write_paths.py --dir /big/disk/x            # 4 GiB written, then read back, in 46 MiB tensors
    python bench/write_paths.py --dir /tmp/x --gib 0.25      # smoke

Writes (the same tensors, made and touched before the clock starts): hlat's ``DirectFile`` (``O_DIRECT`` from reused
aligned buffers, sha256 on its own thread, fsync), the same without sha256, and ``write`` + fsync through the page
cache, as a conversion wrote before (last: its file is the one read). Reads of that file from the page cache (read
once first): into a new ``torch.empty`` per tensor, into ``ranges.empty`` (new, advised to 2 MiB pages), into one
reused tensor, and ``ranges.mapped`` (copied into the reused tensor, as a writer copies what it writes). Each row:
wall seconds, MB/s and the process's CPU seconds per GB (user + system: the kernel's copies and page faults are
system time).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hlat.checkpoint import ranges
from hlat.checkpoint.direct import DirectFile, DirectIO

PIECE = 46 << 20
"""Bytes of each tensor: a 1.1B model's down projection in fp32."""


def timed(what: str, nbytes: int, run: Callable[[], None]) -> None:
    """Run ``run`` and print its row."""
    cpu, start = os.times(), time.perf_counter()
    run()
    seconds, after = time.perf_counter() - start, os.times()
    used = after.user + after.system - cpu.user - cpu.system
    print(f"| {what} | {seconds:.2f} | {nbytes / seconds / 1e6:.0f} | {used / (nbytes / 1e9):.2f} |")


def write_buffered(path: Path, tensors: list[torch.Tensor]) -> None:
    """``tensors`` into ``path`` through the page cache, then fsync: a plain writer."""
    with open(path, "wb") as f:
        for t in tensors:
            f.write(ranges.writable(t))
        f.flush()
        os.fsync(f.fileno())


def write_direct(path: Path, tensors: list[torch.Tensor], digest: bool) -> None:
    """``tensors`` into ``path`` through hlat's ``DirectFile`` (synced as it closes)."""
    with DirectIO() as io, DirectFile(path, io, digest=digest) as f:
        for t in tensors:
            f.write(ranges.writable(t))


def read_into(path: Path, n: int, new: Callable[[], torch.Tensor]) -> None:
    """The ``n`` tensors of ``path``, each read with ``pread`` into the tensor ``new()`` gives."""
    with open(path, "rb") as f:
        for i in range(n):
            t = new()
            ranges.pread_into(f.fileno(), ranges.writable(t), i * PIECE, path)
            del t


def read_mapped(path: Path, n: int, into: torch.Tensor) -> None:
    """The ``n`` tensors of ``path``, each mapped and copied into ``into`` (as a writer copies it), then released."""
    with open(path, "rb") as f:
        for i in range(n):
            t = ranges.mapped(f, i * PIECE, (PIECE,), torch.uint8)
            into.copy_(t)
            ranges.release(t)


def writes(path: Path, n: int) -> None:
    """The write rows: the same ``n`` tensors, made and touched before any clock starts."""
    tensors = [torch.randint(0, 255, (PIECE,), dtype=torch.uint8) for _ in range(n)]
    for what, digest in (("write direct (DirectFile, sha256)", True), ("write direct, no sha256", False)):
        path.unlink(missing_ok=True)
        timed(what, n * PIECE, lambda d=digest: write_direct(path, tensors, d))
    path.unlink()
    timed("write buffered + fsync", n * PIECE, lambda: write_buffered(path, tensors))  # the file the reads read


def reads(path: Path, n: int) -> None:
    """The read rows, from the page cache."""
    reused = torch.empty(PIECE, dtype=torch.uint8)
    read_into(path, n, lambda: reused)  # the file into the page cache, the reused tensor faulted in
    fresh = [
        ("read into fresh torch.empty", lambda: torch.empty(PIECE, dtype=torch.uint8)),
        ("read into ranges.empty (2 MiB pages)", lambda: ranges.empty((PIECE,), torch.uint8)),
        ("read into one reused tensor", lambda: reused),
    ]
    for what, new in fresh:
        timed(what, n * PIECE, lambda new=new: read_into(path, n, new))
    timed("ranges.mapped, copied into one reused tensor", n * PIECE, lambda: read_mapped(path, n, reused))


def main() -> None:
    """Write, then read, ``--gib`` GiB in ``--dir``; print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="a directory on the disk to measure")
    p.add_argument("--gib", type=float, default=4.0, help="GiB written and read (default 4)")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path, n = args.dir / "write_paths.bin", max(2, int(args.gib * 2**30 / PIECE))
    print(f"{n} tensors of {PIECE >> 20} MiB; torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"load {os.getloadavg()[0]:.1f}\n\n| path | s | MB/s | CPU s per GB |\n|---|---|---|---|")
    writes(path, n)
    reads(path, n)
    path.unlink()


if __name__ == "__main__":
    main()
