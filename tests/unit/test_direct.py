"""Files written past the page cache (``hlat.checkpoint.direct``): the bytes, their digest, and every way out; and
tensors mapped from a file rather than read (``hlat.checkpoint.ranges.mapped``): their values, and memory given up.

The reference is independent: the bytes handed in, concatenated, and ``hashlib``'s sha256 of them. The writes are
real (``O_DIRECT`` on the test's file system where it takes it); a refusal at open and a full device are real too
(``/dev/full``); a refusal of the alignment mid-file and a disk that fills after some blocks are forced by failing
``pwrite`` the way the kernel does (EINVAL, ENOSPC).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlat.checkpoint import direct, ranges
from hlat.checkpoint.direct import ALIGN, DirectFile, DirectIO
from hlat.checkpoint.writer import Writer

SMALL = 16 << 10
"""A buffer of 16 KiB (4 aligned blocks) in these tests, so that every case crosses buffers with little data."""


def takes_direct(where: Path) -> bool:
    """Whether the file system under ``where`` opens files with ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    (where / "probe").unlink()
    return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


pieces = st.lists(st.integers(0, 3 * SMALL + 5), max_size=8).map(
    lambda sizes: [os.urandom(n) if n < 64 else os.urandom(64) * (n // 64) + os.urandom(n % 64) for n in sizes]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces)
def test_the_file_holds_exactly_what_was_written_and_its_sha256(tmp_path: Path, data: list[bytes]) -> None:
    """Any split of the bytes, across buffers, aligned or not, empty pieces and files included."""
    with mock.patch.object(direct, "BLOCK", SMALL), DirectIO(depth=2) as io:
        f = DirectFile(tmp_path / "f", io)
        for piece in data:
            assert f.write(piece) == len(piece)
        assert f.tell() == sum(map(len, data))
        f.close()
        f.close()  # a second close does nothing (DCP closes its streams, then the file system does)
    whole = b"".join(data)
    assert (tmp_path / "f").read_bytes() == whole
    assert f.sha256() == hashlib.sha256(whole).hexdigest()


def test_bytes_go_past_the_page_cache_where_the_file_system_takes_it(tmp_path: Path) -> None:
    if not takes_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT: the fallback tests cover it")
    with DirectIO() as io, DirectFile(tmp_path / "f", io) as f:
        f.write(os.urandom(direct.BLOCK + 100))
        assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT  # full buffers go out through O_DIRECT
    assert (tmp_path / "f").stat().st_size == direct.BLOCK + 100


def test_a_file_system_that_refuses_the_alignment_is_written_through_the_cache(tmp_path: Path) -> None:
    """EINVAL from an O_DIRECT pwrite (a device with larger blocks): the file goes on buffered, bytes intact."""
    real, refused = os.pwrite, []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if hasattr(os, "O_DIRECT") and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    data = os.urandom(3 * SMALL + ALIGN + 7)
    with (
        mock.patch.object(direct, "BLOCK", SMALL),
        mock.patch.object(direct.os, "pwrite", pwrite),
        DirectIO() as io,
        DirectFile(tmp_path / "f", io) as f,
    ):
        f.write(data)
    assert (tmp_path / "f").read_bytes() == data
    assert len(refused) <= 1  # refused once, then the file is written buffered
    if takes_direct(tmp_path):
        assert refused == [0]


def test_without_o_direct_the_same_path_writes_through_the_cache(tmp_path: Path) -> None:
    data = os.urandom(2 * SMALL + 3)
    with (
        mock.patch.object(direct, "BLOCK", SMALL),
        mock.patch.object(direct, "_DIRECT", 0),
        DirectIO() as io,
        DirectFile(tmp_path / "f", io) as f,
    ):
        f.write(data)
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
    assert (tmp_path / "f").read_bytes() == data


def test_a_full_disk_is_raised_to_the_caller_and_no_descriptor_is_left(tmp_path: Path) -> None:
    real = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if offset >= SMALL:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    before = open_fds()
    with mock.patch.object(direct, "BLOCK", SMALL), mock.patch.object(direct.os, "pwrite", pwrite), DirectIO() as io:
        f = DirectFile(tmp_path / "f", io)
        with pytest.raises(OSError, match="No space left") as raised:
            for _ in range(8):  # the error of an earlier buffer comes back at a later write, or at close
                f.write(os.urandom(SMALL))
            f.close()
        assert raised.value.errno == errno.ENOSPC
        f.abort()
    assert open_fds() == before


def test_a_real_device_that_refuses_o_direct_and_is_full(tmp_path: Path) -> None:
    """``/dev/full``: the kernel refuses ``O_DIRECT`` at open (EINVAL), so the file opens through the cache, and every
    write fails with ENOSPC: raised on the caller's thread, and no descriptor is left open."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    before = open_fds()
    with DirectIO() as io:
        f = DirectFile(Path("/dev/full"), io, fsync=False)
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
        with pytest.raises(OSError) as raised:  # at the write after the first full buffer failed, or at close
            f.write(os.urandom(direct.BLOCK + 10))
            f.close()
        assert raised.value.errno == errno.ENOSPC
        f.abort()
    assert open_fds() == before


def test_the_writer_hands_the_disk_error_to_the_caller(tmp_path: Path) -> None:
    """``Writer`` (xser's files): a failed write on its threads is raised at ``close``, nothing hangs."""

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with (
        mock.patch.object(direct.os, "pwrite", pwrite),
        pytest.raises(OSError, match="No space left"),
        Writer(tmp_path, limit_bytes=1 << 20) as w,
    ):
        for i in range(4):
            w.save(torch.ones(1 << 20), tmp_path / "d" / f"t{i}.pt")


def test_the_writer_files_load_and_match_their_digests(tmp_path: Path) -> None:
    tensors = {f"a/t{i}.pt": torch.randn(1000 * i + 1) for i in range(5)}
    with Writer(tmp_path, limit_bytes=1 << 16) as w:
        for name, t in tensors.items():
            w.save(t, tmp_path / name)
    for name, t in tensors.items():
        f = tmp_path / name
        assert torch.equal(torch.load(f, weights_only=True), t)
        assert w.digests[f] == (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())


def rss_file() -> int:
    """Bytes of file pages mapped into this process (``RssFile``)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]),
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.integers(0, 9000),
)
def test_a_mapped_tensor_is_the_saved_one_and_writing_to_it_leaves_the_file(
    tmp_path: Path, dtype: torch.dtype, shape: list[int], before: int
) -> None:
    """A ``torch.save`` zip appended after ``before`` bytes (DCP's files hold one per tensor), mapped in place."""
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, shape)
    f = tmp_path / "t.bin"
    with open(f, "wb") as out:
        out.write(os.urandom(before))
        torch.save(t, out)
    raw = f.read_bytes()
    with open(f, "rb") as fh:
        start = ranges.data_offset(fh, t.nbytes, before, len(raw) - before)
        assert start is not None
        m = ranges.mapped(fh, start, tuple(shape), dtype)
    assert torch.equal(m, t) and ranges.is_mapped(m)
    m.zero_()  # copy on write: the tensor's pages are its own from here
    assert f.read_bytes() == raw
    ranges.release(m)
    assert not ranges.is_mapped(m)


def test_a_released_mapping_gives_its_pages_back(tmp_path: Path) -> None:
    t = torch.randn(16 << 20)  # 64 MiB
    f = tmp_path / "t.pt"
    torch.save(t, f)
    with open(f, "rb") as fh:
        start = ranges.data_offset(fh, t.nbytes)
        assert start is not None
        m = ranges.mapped(fh, start, tuple(t.shape), t.dtype)
    before = rss_file()
    assert torch.equal(m, t)  # every page touched
    touched = rss_file()
    ranges.release(m)  # as the DCP writer's planner does once the tensor is written, while DCP still holds it
    assert touched - before > 48 << 20 and touched - rss_file() > 48 << 20
