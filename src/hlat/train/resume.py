"""Continuing a run: which start of the job this is, what it resumes from, and putting the checkpoint back.

Also the job's record (restarts, uptime, its MLflow run) and the rollback policy of a non-finite step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from torch import nn

from hlat import checkpoint
from hlat.backends.base import Backend, read_extra
from hlat.checkpoint import job_dir
from hlat.checkpoint.xser_write import resharded_copy
from hlat.config import ConfigError, RunConfig
from hlat.data import Loader
from hlat.data.loader import CHECKPOINT
from hlat.data.slots import gather
from hlat.launch import attempt
from hlat.state import HaltedError, NonFiniteError, TrainState
from hlat.track.goodput import Attempt, Ledger, process_start
from hlat.track.metrics import MetricsLogger, SpikeDetector, Uptime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobStart:
    """This start of the trainer within its job: where its checkpoints go and what it continues from."""

    root: Path
    """The checkpoint directory (``train.checkpoint_dir``, or ``<run dir>/checkpoints``)."""
    resume: str
    """``train.resume`` for this attempt (a torch elastic restart continues the job's own progress)."""
    resume_from: Path | None
    """The checkpoint this start restores, or None (a new job, or ``train.resume=never``)."""
    launched: float
    """When this process started (the job's start, unless its record says it started earlier)."""
    lock: IO | None = None
    """The trainer lock on ``root`` (rank 0), released when the run ends."""
    changed: dict[str, str] = dataclasses.field(default_factory=dict)
    """The settings changed since the checkpoint this start restores: key -> ``"old -> new"``."""
    checks: checkpoint.Checks = checkpoint.ALONE
    """How this rank verifies a checkpoint: its share of the files, pooled with the job's ranks."""


def begin(cfg: RunConfig, run_dir: Path) -> float:
    """First thing of every start: the ranks agree which restart this is, and the start is counted.

    Counted before anything can fail (:func:`record_start`), so a restart that dies in start-up still counts.

    Returns:
        When this start began (``time.time()``).
    """
    launched = time.time()
    attempt.current(timeout_s=cfg.health.collective_timeout_s)
    record_start(checkpoint.checkpoint_root(cfg, run_dir), cfg.train.resume, launched)
    return launched


def open_job(cfg: RunConfig, run_dir: Path, new_bytes: int, launched: float, rank: int) -> JobStart:
    """What this start continues from, checked read-only before anything is built; then the record and the lock.

    A new job's record is written once the read-only checks pass; rank 0 then takes the trainer lock (one trainer per
    checkpoint directory: another one holding it is refused here, before anything is built).

    Args:
        cfg: The run's config.
        run_dir: The run directory.
        new_bytes: The size of a checkpoint of this run when there is none to measure (weights + optimizer).
        launched: When this process started.
        rank: This process's rank (rank 0 takes the lock).

    Raises:
        ConfigError: The checkpoint to resume from was written by an incompatible config, or another trainer holds
            the directory.
        CheckpointError: No usable checkpoint where one is required, or too little disk for the next one.
    """
    root = checkpoint.checkpoint_root(cfg, run_dir)
    resume = checkpoint.restart_resume(cfg.train.resume, root)
    checks = checkpoint.shared_checks()  # the ranks verify the checkpoint's sha256s together: each file read once
    resume_from = checkpoint.find_resume(resume, root, checks)
    changed = {}
    if resume_from is not None:  # before anything is built, or any directory made
        changed = checkpoint.check_compatible(resume_from, dataclasses.asdict(cfg))
    checkpoint.check_disk_space(root, checkpoint.checkpoint_bytes(resume_from) or new_bytes)
    record_start(root, cfg.train.resume, launched, create=True)  # a new job: the read-only checks made no directory
    lock = checkpoint.hold_lock(root) if rank == 0 else None
    return JobStart(root, resume, resume_from, launched, lock, changed, checks)


def resume_job(
    job: JobStart,
    backend: Backend,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Loader,
    spikes: SpikeDetector,
) -> tuple[TrainState, Uptime, str | None]:
    """Put back what this start continues from (nothing for a new job), with the job's uptime and MLflow run.

    The uptime carries this attempt's goodput ledger (:func:`goodput_ledger`), its start-up and load charged.

    Returns:
        The progress to train from, the job's uptime accounting and the MLflow run a restart continues (or None).
    """
    state, saved = TrainState(), {}
    loading = time.time()
    if job.resume_from is not None:
        state, saved = restore(backend, job.resume_from, model, optimizer, data, spikes)
    load_s = time.time() - loading
    latest = checkpoint.read_job(job.root) if job.resume != "never" else {}
    uptime, run_id = job_record(saved, latest, job.launched)
    uptime.ledger = goodput_ledger(job, state.step, load_s)
    return state, uptime, run_id


def goodput_ledger(job: JobStart, resumed_step: int, load_s: float) -> Ledger:
    """This attempt's goodput ledger, after the job's earlier attempts' (read from ``<checkpoint dir>/goodput/``).

    Rank 0 keeps it in the job directory; a new job (``train.resume=never``) first forgets an earlier job's ledgers.
    Its clock starts at this process's start (a torch elastic restart: the new worker's), or for a later run in the
    same process at its launch.
    """
    writer = int(os.environ.get("RANK", "0")) == 0
    if job.resume == "never" and writer:
        job_dir.clear_attempts(job.root)
    previous = [Attempt.from_dict(r) for r in job_dir.read_attempts(job.root)] if job.resume != "never" else []

    def write(attempt: Attempt) -> None:
        job_dir.write_attempt(job.root, attempt.attempt, attempt.to_dict())

    global _LEDGERS_BEGUN
    # A second run in this process (the jobs of a sweep run one after another in one process) starts at its launch.
    started = min(process_start(), job.launched) if not _LEDGERS_BEGUN else job.launched
    _LEDGERS_BEGUN += 1
    return Ledger.begin(previous, started, resumed_step, load_s, write if writer else None)


_LEDGERS_BEGUN = 0
"""Goodput ledgers begun in this process (:func:`goodput_ledger`)."""


def restore(
    backend: Backend,
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Loader,
    spikes: SpikeDetector,
) -> tuple[TrainState, dict]:
    """Load a checkpoint into the built model, optimizer, loader and spike statistics.

    The loader's position is per sequence slot of the global batch: on another data-parallel degree this rank
    gathers its slots' positions from the saved ranks that served them (:func:`loader_state`).

    Returns:
        The saved progress, and the job record (MLflow run id, uptime accounting; empty in older checkpoints).
    """
    copy = _in_this_layout(backend, path)
    try:
        extra = backend.load(copy or path, model, optimizer)
    finally:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
    try:
        data.load_state_dict(loader_state(path, extra["data"], data.slots))
    except ConfigError as e:  # the loader cannot know which checkpoint it was given: name it, and in the fix
        raise ConfigError(f"{path}: {e}".replace(CHECKPOINT, str(path))) from None
    if "spikes" in extra:
        spikes.load_state_dict(extra["spikes"])
    torch.set_rng_state(extra["rng"])
    state = TrainState(**extra["train_state"])
    log.info("resumed from %s at step %d", path, state.step)
    return state, extra.get("job", {})


def _in_this_layout(backend: Backend, path: Path) -> Path | None:
    """A neuron checkpoint saved in another layout, resharded for this rank (None: load ``path`` as it is).

    NxD loads only the layout it saved; the torch backend reshards in DCP's load itself.
    """
    if backend.name != "neuron":
        return None
    cfg, dims, ranks = backend.cfg, backend.dims, backend.ranks  # type: ignore[attr-defined]
    return resharded_copy(path, cfg, dims, ranks.rank)


def loader_state(path: Path, own: dict, slots: range) -> dict:
    """The saved loader state of ``slots``, read from the checkpoint's ranks that served them (``hlat.data.slots``).

    Saved data-parallel rank ``d``'s first global rank is ``d * tp`` (ranks are laid out ``[pp, dp, tp]``), with the
    saving run's ``parallelism.tp`` from the manifest.
    """
    tp = int((checkpoint.manifest(path) or {}).get("config", {}).get("parallelism", {}).get("tp", 1))
    return gather(own, slots, lambda dp_rank: read_extra(path, dp_rank * tp)["data"])


COUNTED = "start_counted"
"""Key of a job record that :func:`record_start` wrote: its ``uptime.restarts`` already counts the start reading it."""


def record_start(root: Path, resume: str, launched: float, *, create: bool = False) -> None:
    """Count this start of the trainer in the job record (``<checkpoint dir>/job.json``) before anything can fail.

    Rank 0 (``RANK``, as torchrun sets it) calls it twice. First thing (``create=False``): a start that resumes the
    job (its record exists and ``train.resume``, as :func:`hlat.checkpoint.restart_resume` makes it for this
    attempt, is not ``never``) is one more restart. Counted here, a restart that dies in start-up (setting up the
    device, the pre-flight check, building, restoring) still counts, as the next start reads it back. Then, once the
    read-only resume checks have passed (``create=True``), a new job records that it started: a run refused before that
    makes no directory.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return
    resume = checkpoint.restart_resume(resume, root)
    if resume == "never" and any(root.glob("step_*/manifest.json")):
        return  # find_resume refuses this directory in a moment: leave its job's record alone
    record = checkpoint.read_job(root) if resume != "never" else {}
    if "uptime" in record:
        if create:
            return  # counted by the first call
        uptime = Uptime.resumed(record["uptime"])  # one more restart of the same job
    elif not create:
        return  # a new job: recorded after the read-only checks
    else:
        uptime, record = Uptime(launched), {}
    checkpoint.write_job(root, {**record, "uptime": uptime.state_dict(), COUNTED: True})
    if uptime.restarts:
        log.info(
            "start %d of this job (restart %d), recorded in %s",
            uptime.restarts + 1,
            uptime.restarts,
            root / checkpoint.JOB,
        )


def job_record(saved: dict, latest: dict, launched: float) -> tuple[Uptime, str | None]:
    """The job's uptime accounting and MLflow run id, from the resumed checkpoint and the job record.

    ``saved`` (the checkpoint's copy) holds the productive time up to that checkpoint; ``latest`` (``job.json``,
    rewritten at every start) knows restarts that died before a newer checkpoint, and a job killed before its first
    checkpoint. Where :func:`record_start` wrote it, its restart count already includes this start. Both empty: a
    new job started at ``launched``.
    """
    base = saved.get("uptime") or latest.get("uptime")
    uptime = Uptime.resumed(base) if base else Uptime(launched)
    uptime.restarts = saved["uptime"]["restarts"] + 1 if "uptime" in saved else 0
    if "uptime" in latest:
        uptime.start = min(uptime.start, latest["uptime"]["start"])
        this_start = 0 if latest.get(COUNTED) else 1
        uptime.restarts = max(uptime.restarts, latest["uptime"]["restarts"] + this_start)
    return uptime, saved.get("mlflow_run_id") or latest.get("mlflow_run_id")


MAX_DISCARDS_PER_STEP = 3
"""Rollbacks that may discard a batch at the same step before the run halts (the instability is not one batch)."""


def halt_message(e: NonFiniteError, why: str, ckpt: Path | None, root: Path) -> str:
    """The one line of a halt on a non-finite step: what happened, what was saved, and the way on from there.

    With a checkpoint the run continues from it once the cause is fixed; without one there is nothing to continue,
    so the same command starts again from step 0 (and rollback has nothing to go back to before a first save).
    """
    if ckpt is not None:
        return (
            f"{e} ({why}); nothing non-finite was checkpointed and the newest valid checkpoint is {ckpt}. Lower "
            "optimizer.lr or raise optimizer.warmup_steps, or set train.on_nonfinite=rollback / skip_step, then "
            "continue from that checkpoint in the same run directory (train.resume=auto)"
        )
    earlier = (  # a checkpoint before the step that failed, for rollback to go back to; none precedes step 1
        f", or save before step {e.step} (train.checkpoint_every below {e.step}) so that rollback has a checkpoint"
        if e.step > 1
        else ""
    )
    return (
        f"{e} ({why}); there is no checkpoint in {root} to continue from. Lower optimizer.lr or raise "
        f"optimizer.warmup_steps, or set train.on_nonfinite=skip_step (drop such a step's update){earlier}; then run "
        "the command again: it starts from step 0"
    )


def rollback(
    e: NonFiniteError,
    state: TrainState,
    policy: str,
    saver: checkpoint.Checkpointer,
    root: Path,
    logger: MetricsLogger,
    uptime: Uptime,
    restore: Callable[..., tuple[TrainState, dict]],
    checks: checkpoint.Checks = checkpoint.ALONE,
) -> TrainState:
    """on_nonfinite=rollback: reload the newest valid checkpoint and discard the offending step's batch.

    Every rank comes here at the same step (the loss and gradient norm it checks are global), so ``checks`` may be
    the job's shared ones.

    Raises:
        HaltedError: The policy is halt, there is no checkpoint to go back to, or the same step went non-finite
            ``MAX_DISCARDS_PER_STEP`` times.
    """
    saver.wait()  # on rank 0, until the newest save is renamed into place; on the others, until their files are written
    checks.together()  # so that every rank lists the same checkpoints
    ckpt = checkpoint.latest(root, checks)
    why = None
    if policy == "halt":
        why = "train.on_nonfinite=halt"
    elif ckpt is None:
        why = "train.on_nonfinite=rollback has no checkpoint to go back to"
    elif state.discarded_batches.count(e.step) >= MAX_DISCARDS_PER_STEP:
        why = f"{MAX_DISCARDS_PER_STEP} batches in a row went non-finite at this step: the run is unstable"
    if why is not None:
        raise HaltedError(halt_message(e, why, ckpt, root)) from None
    restored, job = restore(ckpt)
    restored.discarded_batches = [*state.discarded_batches, e.step]
    restored.rollbacks = state.rollbacks + 1
    if "uptime" in job:  # the work since the checkpoint is lost: productive time goes back to its value there
        uptime.productive_s = job["uptime"]["productive_s"]
    if uptime.ledger is not None:
        uptime.ledger.rewind(restored.step)
    logger.rewind()
    log.warning(
        "%s: rolled back to %s (rollback %d); the batch of step %d will be discarded",
        e,
        ckpt,
        restored.rollbacks,
        e.step,
    )
    return restored
