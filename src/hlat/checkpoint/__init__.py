"""Checkpoints: atomic, verified step directories, the job files beside them, and reading their weights.

The backend writes into ``step_XXXXXXXX.tmp/``; ``manifest.json`` (sizes, sha256s, config) goes in last and the
directory is renamed, so one without a manifest is never loaded and one that fails its checksums is skipped.
May import: ``hlat.config``, the core, ``hlat.launch``, ``hlat.plan``, ``hlat.data``, ``hlat.backends``, ``hlat.track``.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from hlat.backends.base import Backend
from hlat.checkpoint.job_dir import (  # noqa: F401  the job files beside the checkpoints, re-exported for checkpoint.* callers
    JOB,
    LOCK,
    check_disk_space,
    check_writable,
    hold_lock,
    is_locked,
    read_job,
    write_job,
)
from hlat.checkpoint.manifest import (  # noqa: F401  re-exported for checkpoint.* callers
    LAYOUT_KEYS,
    MANIFEST,
    SHAPE_KEYS,
    check_compatible,
    checkpoint_bytes,
    config_hash,
    manifest,
    problems,
    sha256,
    step_dir,
)
from hlat.checkpoint.verify import ALONE, Checks, shared_checks  # noqa: F401  re-exported for checkpoint.* callers
from hlat.config import ConfigError, RunConfig
from hlat.state import StepOutput, TrainState

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the cause and which checkpoints are intact."""


def latest(root: Path, checks: Checks = ALONE) -> Path | None:
    """The newest complete checkpoint under ``root`` whose files match their checksums (None if there is none).

    Newer directories that are incomplete or corrupt are skipped with a warning that names them. A ``step_N.tmp``
    is never one, even with a valid manifest: the rename is what declares a save complete (a kill between the
    manifest and the rename leaves it), and the next save removes it. ``checks``: alone, or shared by the job's ranks.
    """
    if not root.is_dir():
        return None
    for p in sorted(root.glob("step_*"), reverse=True):
        bad = ["an interrupted save (never renamed)"] if p.name.endswith(".tmp") else checks.problems(p)
        if not bad:
            return p
        log.warning("skipping checkpoint %s: %s", p, "; ".join(bad))
    return None


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` with a well-formed manifest and every file at its size (None: none).

    Without checksums (unlike :func:`latest`): cheap enough for a message naming what a rerun continues from.
    """
    for p in sorted(root.glob("step_*"), reverse=True):
        if not p.name.endswith(".tmp") and not problems(p):
            return p
    return None


def resolve(path: str, key: str = "train.resume", checks: Checks = ALONE) -> Path:
    """A checkpoint directory, or the latest valid one under a checkpoints root; ConfigError on ``key`` if none."""
    p = Path(path).expanduser()
    if (manifest(p) or {}).get("weights_only"):
        raise ConfigError(
            f"train.resume={path} holds weights only (written by hlat import), no optimizer or data "
            f"state to resume: start a new run from it with train.init_from={path}"
        )
    if (p / MANIFEST).exists():  # the user named one checkpoint: it must be intact (its manifest too)
        bad = checks.problems(p)
        if bad:
            raise ConfigError(
                f"{key}={path}: this checkpoint is damaged ({'; '.join(bad)}); "
                f"point {key} at its parent directory to use the newest intact one"
            )
        return p
    found = latest(p, checks)
    if found is None:
        others = ", or use train.resume=auto (this run's own checkpoints) or train.resume=never (start fresh)"
        raise ConfigError(
            f"{key}={path}: no complete checkpoint there (a step_* directory with {MANIFEST}); point {key} at a "
            f"checkpoint or a checkpoints directory that holds one{others if key == 'train.resume' else ''}"
        )
    return found


def find_resume(resume: str, root: Path, checks: Checks = ALONE) -> Path | None:
    """The checkpoint a run starts from under ``train.resume`` (auto | never | a path), given its checkpoint root.

    ``never`` refuses a ``root`` that already holds a valid checkpoint: the new run's would mix with the old ones.
    ``checks``: alone, or shared by the job's ranks (:func:`shared_checks`; then every rank must call this).
    """
    if resume == "never":
        found = latest(root, checks)
        if found is not None:
            raise ConfigError(
                f"train.resume=never, but the checkpoint directory {root} already holds {found.name}: its "
                "checkpoints would mix with this run's. Use train.resume=auto to continue from it, or set "
                "train.checkpoint_dir to an empty directory"
            )
        return None
    if resume == "auto":
        found = latest(root, checks)
        if found is None:
            log.info("no checkpoint in %s: starting at step 0", root)
        return found
    return resolve(resume, checks=checks)


def checkpoint_root(cfg: RunConfig, run_dir: Path) -> Path:
    """Where the run's checkpoints go: ``train.checkpoint_dir``, or ``<run dir>/checkpoints``."""
    d = cfg.train.checkpoint_dir
    return Path(d).expanduser() if d else run_dir / "checkpoints"


def restart_resume(resume: str, root: Path) -> str:
    """``train.resume`` for this attempt: once the job has checkpoints, a restart continues them (``auto``).

    A restart reruns the same command line, whose ``never`` or path would refuse or rewind the job's own progress.
    """
    # A restart is the attempt every rank agrees on (hlat.launch.attempt.current), not TORCHELASTIC_RESTART_COUNT:
    # a node restarted only because another node's worker died counts 0 there, and would start over.
    from hlat.launch import attempt

    restarted = attempt.current() > 0
    if restarted and (resume == "never" or any(root.glob("step_*/manifest.json"))):
        return "auto"
    return resume


def _disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a disk-full error, or wraps (``CheckpointException.failures``) or follows one."""
    seen: list[BaseException] = []
    todo: list[Any] = [e]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple):
            todo += x
            continue
        if not isinstance(x, BaseException) or any(x is s for s in seen):
            continue
        seen.append(x)
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [x.__cause__, x.__context__, *getattr(x, "failures", {}).values()]
    return False


SaveFault = Callable[[str, int, Path], None]
"""Fault-injection callback: ``(stage, step, directory)`` with stage ``written`` (files written, no manifest yet)
or ``complete`` (renamed into place)."""


class Checkpointer:
    """Loop hook: saves every ``every`` steps (0: never mid-run) and after the last step, at most one save in flight.

    Every rank calls it (the save is collective); rank 0 alone writes the manifest, renames and prunes. With
    ``async_save`` all but the copy to host memory runs in a background thread, whose error the next ``save`` or
    ``wait`` raises. ``extra_fn``: the framework-neutral state; ``on_saved(directory, step)``: runs on rank 0.
    """

    def __init__(
        self,
        backend: Backend,
        root: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_fn: Callable[[TrainState], dict[str, Any]],
        *,
        every: int,
        last_step: int,
        keep_last: int,
        keep_every: int = 0,
        meta: dict[str, Any] | None = None,
        async_save: bool = True,
        fault: SaveFault | None = None,
        rank: int = 0,
        on_saved: Callable[[Path, int], None] | None = None,
    ) -> None:
        self.backend, self.root, self.model, self.optimizer = backend, root, model, optimizer
        self.extra_fn, self.every, self.last_step, self.keep_last = extra_fn, every, last_step, keep_last
        self.keep_every, self.meta, self.async_save, self.fault = keep_every, meta or {}, async_save, fault
        self.rank = rank  # every rank writes its shard; rank 0 alone checksums, renames and prunes
        self.on_saved = on_saved
        """Called on rank 0 with (directory, step) once a checkpoint is complete (e.g. to evaluate it)."""
        self.last_saved: Path | None = None
        self.last_save_s: float | None = None
        """Seconds from ``save`` to the newest checkpoint being complete on disk."""
        self._pending: concurrent.futures.Future | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hlat-ckpt")
        for stale in root.glob("step_*.tmp") if rank == 0 else ():
            log.warning("removing the partial checkpoint %s left by an interrupted save", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        if state.step == self.last_step or (self.every and state.step % self.every == 0):
            self.save(state)

    def save(self, state: TrainState) -> None:
        """Start the checkpoint of ``state.step`` (and wait for it unless asynchronous)."""
        self.wait()  # one save in flight: also raises the previous one's error before more state is at risk
        step, started = state.step, time.perf_counter()
        extra = self.extra_fn(state)
        tmp = step_dir(self.root, step).with_name(step_dir(self.root, step).name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            written = self.backend.save(tmp, self.model, self.optimizer, extra, async_save=self.async_save)
        except (OSError, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise self._failed(e, tmp, step) from e
        if self.async_save:
            self._pending = self._executor.submit(self._finish, tmp, step, written, started)
        else:
            self._finish(tmp, step, written, started)

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete; re-raise its error. Returns the newest save."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self.last_saved

    def close(self) -> None:
        """Finish the save in flight, then stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def _finish(self, tmp: Path, step: int, written: concurrent.futures.Future | None, started: float) -> None:
        try:
            if written is not None:
                written.result()  # on rank 0 that is after every rank's files are written (DCP's last collective)
            if self.rank != 0:
                return
            if self.fault is not None:
                self.fault("written", step, tmp)
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"step": step, "files": files, **self.meta}, f)
                f.flush()
                os.fsync(f.fileno())
            final = step_dir(self.root, step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if self.on_saved is not None:
                try:  # the checkpoint is complete: a failing listener must not make it look failed
                    self.on_saved(final, step)
                except Exception:
                    log.exception("the on_saved hook failed for %s", final)
        except (Exception, CheckpointException) as e:
            raise self._failed(e, tmp, step) from e
        self.last_saved, self.last_save_s = final, time.perf_counter() - started
        log.info(
            "checkpoint %s complete in %.2f s (%.1f MB)",
            final,
            self.last_save_s,
            sum(f["size"] for f in files.values()) / 1e6,
        )
        self._retain()
        if self.fault is not None:
            self.fault("complete", step, final)

    def _failed(self, e: BaseException, tmp: Path, step: int) -> Exception:
        """Remove the partial checkpoint; a CheckpointError that says what happened and what is intact."""
        shutil.rmtree(tmp, ignore_errors=True)
        intact = sorted(p.name for p in self.root.glob("step_*") if not p.name.endswith(".tmp") and not problems(p))
        kept = f"the earlier checkpoints are intact ({', '.join(intact)})" if intact else "there is no earlier one"
        if _disk_full(e):
            return CheckpointError(
                f"no space left on the device writing checkpoint {step_dir(self.root, step).name} to {self.root}; "
                f"the partial checkpoint was removed and {kept}. Free space there (or set train.checkpoint_dir to a "
                "larger volume), then rerun in the same run directory: train.resume=auto continues from the newest one"
            )
        if isinstance(e, CheckpointError):
            return e
        return CheckpointError(f"writing checkpoint {step_dir(self.root, step).name} failed ({e!r}); {kept}")

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        done = [p for p in sorted(self.root.glob("step_*")) if not p.name.endswith(".tmp")]
        for old in done[: -self.keep_last]:
            if self.keep_every and int(old.name.removeprefix("step_")) % self.keep_every == 0:
                continue  # a permanent checkpoint
            (old / MANIFEST).unlink(missing_ok=True)  # invalidate first: a half-deleted dir is never loaded
            shutil.rmtree(old, ignore_errors=True)
