"""Where a conversion reads and writes: its source found and opened, its new directory written atomically.

A conversion never writes into its source, refuses a destination that holds something (unless told to replace
it), writes into ``<dst>.tmp-<pid>`` and renames that into place last, so an interrupted one leaves no ``dst``.
May import: ``hlat.config``, the rest of ``hlat.checkpoint``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hlat import checkpoint as ckpt
from hlat import safe_load
from hlat.checkpoint.portable import HFCheckpoint, Reader, TorchCheckpoint
from hlat.checkpoint.weights import find_checkpoint
from hlat.checkpoint.xser_reshard import RangedCheckpoint
from hlat.config import ConfigError

log = logging.getLogger(__name__)


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (``config.json``, no hlat manifest)."""
    return (path / "config.json").is_file() and ckpt.manifest(path) is None


def source_dir(src: str | Path) -> Path:
    """The directory ``src`` names: a HF model directory, an hlat step directory, or the newest intact one under it.

    A step directory is verified by its reader (checksums are read once).
    """
    p = Path(src).expanduser()
    return p if is_hf_dir(p) or ckpt.manifest(p) is not None else find_checkpoint(p)


def open_checkpoint(path: Path) -> Reader:
    """The reader of an hlat step directory (torch or neuron backend) or of a Hugging Face model directory.

    Raises:
        ConfigError: The source is damaged, partial, or of a kind this build cannot read.
    """
    if is_hf_dir(path):
        return HFCheckpoint(path)
    backend = ((ckpt.manifest(path) or {}).get("config") or {}).get("cluster", {}).get("backend", "torch")
    if backend == "neuron":
        return RangedCheckpoint(path)  # each piece's bytes straight into the full tensor
    if not (path / safe_load.METADATA).is_file():
        raise ConfigError(f"checkpoint {path} has no {safe_load.METADATA}: it is not a torch.distributed.checkpoint")
    return TorchCheckpoint(path)


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    """ConfigError if ``dst`` is, holds or lies inside ``src``, or holds anything and ``overwrite`` is off."""
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise ConfigError(
            f"the destination {dst} overlaps the source {src}: a conversion never writes into its source; "
            "choose a directory outside it"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise ConfigError(f"{dst} is not empty; choose a new directory or pass --overwrite to replace it")


@contextmanager
def atomic_dir(dst: Path, *, needed: int) -> Iterator[Path]:
    """A new directory to fill; renamed to ``dst`` (replacing it) when the block ends, removed if it fails.

    ``needed``: bytes the output takes about, checked against the free space first. Leftovers of a conversion
    that was killed (``<dst>.tmp-<pid>`` of a process that is gone) are removed.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in dst.parent.glob(f"{dst.name}.tmp-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            log.warning("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
    free = shutil.disk_usage(dst.parent).free
    if free < needed:
        raise ConfigError(
            f"{dst.parent} has {free / 2**30:.2f} GiB free, but the conversion writes about {needed / 2**30:.2f} GiB; "
            "free space there or choose a destination on a larger volume"
        )
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if dst.is_dir() and any(dst.iterdir()):  # --overwrite: out of the way first, removed once replaced
            old = dst.with_name(f"{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old)
        else:
            if dst.exists():
                dst.rmdir() if dst.is_dir() else dst.unlink()
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
