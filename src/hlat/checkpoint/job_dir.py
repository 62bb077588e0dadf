"""The checkpoint directory as the job's home: writable and large enough, its job record, its one-trainer lock.

The files beside the step directories: ``job.json`` (MLflow run id, uptime accounting), ``goodput/`` (each attempt's
goodput ledger, :mod:`hlat.track.goodput`) and ``.lock``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hlat.config import ConfigError

log = logging.getLogger(__name__)

JOB = "job.json"
"""The job record in the checkpoint directory."""


def check_writable(root: Path) -> Path:
    """ConfigError unless the checkpoint directory ``root`` is, or can be created as, a writable directory.

    Returns:
        ``root`` or its nearest existing ancestor (the directory whose volume the checkpoints will use).
    """
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fix = "set train.checkpoint_dir (or hydra.run.dir, which holds checkpoints/ by default) to a writable directory"
    if not probe.is_dir():
        raise ConfigError(
            f"train.checkpoint_dir={root}: {probe} is a file, not a directory, so the checkpoints "
            f"cannot go there; {fix}"
        )
    try:  # a real write: permissions, read-only mounts and pseudo filesystems (/proc) alike
        with tempfile.TemporaryFile(dir=probe, prefix=".hlat-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"train.checkpoint_dir={root}: cannot write into {probe} ({e.strerror or e}); {fix}"
        ) from None
    return probe


def check_disk_space(root: Path, needed: int) -> None:
    """ConfigError if ``root`` is not writable or its volume has less than ``needed`` bytes free (one checkpoint)."""
    probe = check_writable(root)
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ConfigError(
            f"train.checkpoint_dir={root}: {free / 2**30:.2f} GiB free, but one checkpoint needs about "
            f"{needed / 2**30:.2f} GiB; free space there or point train.checkpoint_dir at a larger volume"
        )


def read_job(root: Path) -> dict[str, Any]:
    """The job record (MLflow run id, start time) of the run writing into ``root``; empty if there is none."""
    try:
        record = json.loads((root / JOB).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        log.warning("ignoring %s: it holds a JSON %s, not the job record", root / JOB, type(record).__name__)
        return {}
    return record


def write_job(root: Path, record: dict[str, Any]) -> None:
    """Record the job (atomically), so a restart before the first checkpoint still continues the same run.

    Raises:
        ConfigError: ``root`` cannot be a writable directory (the first write of a run: it names the key and fix).
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{JOB}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, root / JOB)
    except OSError:
        check_writable(root)  # a ConfigError naming train.checkpoint_dir when the directory is the cause
        raise


GOODPUT = "goodput"
"""The directory of the attempts' goodput ledgers in the checkpoint directory: ``attempt_0000.json`` ..."""


def write_attempt(root: Path, number: int, record: dict[str, Any]) -> None:
    """Write attempt ``number``'s goodput ledger (atomically: a SIGKILL leaves the previous version whole)."""
    folder = root / GOODPUT
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".attempt_{number:04d}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"attempt_{number:04d}.json")


def read_attempts(root: Path) -> list[dict[str, Any]]:
    """The goodput ledgers of the job's attempts in ``root``, first attempt first; unreadable ones are skipped."""
    records = []
    for path in sorted((root / GOODPUT).glob("attempt_*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("ignoring %s: not a readable goodput ledger", path)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def clear_attempts(root: Path) -> None:
    """Forget the ledgers of an earlier job in ``root`` (a new job starts there: ``train.resume=never``)."""
    shutil.rmtree(root / GOODPUT, ignore_errors=True)


LOCK = ".lock"
_HELD: dict[Path, Any] = {}
"""The directory locks this process holds, by resolved checkpoint root."""


def hold_lock(root: Path) -> Any:
    """Lock ``root`` for this trainer (rank 0) until the returned file is closed or the process dies.

    Two trainers writing one directory would corrupt each other's resume. Returns None where there are no locks.

    Raises:
        ConfigError: Another live process holds the lock.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    root.mkdir(parents=True, exist_ok=True)
    key = root.resolve()
    if key in _HELD:  # this process trained here before and failed without closing it: one trainer per process
        _HELD.pop(key).close()
    f = open(root / LOCK, "a+")  # noqa: SIM115 (held open for the whole run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(
            f"another process is training into {root} (it holds {root / LOCK}); wait for it to end, or give this "
            "run its own directory (hydra.run.dir=... or train.checkpoint_dir=...)"
        ) from None
    except OSError as e:  # e.g. ENOLCK on a network filesystem mounted without locks
        f.close()
        log.warning("cannot lock %s (%s): nothing stops two trainers from sharing this directory", root, e)
        return None
    _HELD[key] = f
    return f


def is_locked(root: Path) -> bool:
    """Whether a live trainer holds ``root`` (:func:`hold_lock`)."""
    try:
        import fcntl

        with open(root / LOCK, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
    except BlockingIOError:
        return True
    except (ImportError, OSError):
        return False
    return False
