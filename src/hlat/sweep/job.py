"""One job of a Hydra multirun: skip it if it finished, continue it if it died, train it otherwise; record the end.

A job whose config hash (:func:`hlat.track.sweep.config_hash`) matches a FINISHED run of its MLflow experiment is
skipped; one whose run died continues from that run's newest checkpoint (``tracker.skip_finished=false`` runs all).
Rank 0 decides and writes ``<job dir>/sweep_job.json``; the other ranks read it, so they cannot disagree. Imports
``hlat.config``, ``hlat.checkpoint``, ``hlat.track`` and ``hlat.launch.preempt``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hlat import checkpoint
from hlat.checkpoint import checkpoint_root, read_job
from hlat.config import RunConfig
from hlat.launch.preempt import PREEMPTED_EXIT_CODE, AbortedError, PreemptedError, hand_over
from hlat.track.runs import objective
from hlat.track.sweep import HASH_TAG, JOB_FILE, config_hash, default_run_name, rank, read_record, write_json

log = logging.getLogger(__name__)

WAIT_S = 600.0
"""How long a rank other than 0 waits for rank 0's decision before giving up."""


@dataclass
class Decision:
    """What a sweep job does: ``train`` (from scratch, or its own checkpoints), ``skip`` or ``resume``."""

    action: str
    config_hash: str
    run_id: str | None = None
    """skip: the FINISHED run of the same config; resume: the run that died and is continued."""
    checkpoint_dir: str | None = None
    """resume: the checkpoint root of that run."""


def _wait_for(job_dir: Path, key: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    """Rank 0's record once it holds ``key`` (ranks other than 0 only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_record(job_dir)
        if key in record:
            return record
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank()} waited {timeout_s:.0f} s for rank 0 to write {key!r} into {job_dir / JOB_FILE}; "
                "rank 0 failed or the job directory is not on storage every node sees (hydra.sweep.dir)"
            )
        time.sleep(0.2)


def decide(cfg: Any, job_dir: Path) -> Decision:
    """This sweep job's :class:`Decision` (rank 0 decides and records it; the other ranks read the record).

    Args:
        cfg: The job's RunConfig.
        job_dir: The job's output directory (every rank of the job sees the same one).
    """
    job_dir = Path(job_dir)
    if rank() != 0:
        return Decision(**_wait_for(job_dir, "decision")["decision"])
    record = read_record(job_dir)
    if "decision" in record:  # a restart of this job: keep what its first start decided
        return Decision(**record["decision"])
    h = config_hash(dataclasses.asdict(cfg))
    decision = Decision("train", h)
    if cfg.tracker.kind == "mlflow" and cfg.tracker.skip_finished:
        decision = _look_up(cfg, h, job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    write_json(job_dir / JOB_FILE, {"decision": dataclasses.asdict(decision)})
    return decision


def _look_up(cfg: Any, h: str, job_dir: Path) -> Decision:
    """Search the experiment for runs of config hash ``h``: a FINISHED one is reused, a dead one continued."""
    from hlat.track.mlflow_store import open_client, run_store_uri

    client = open_client(run_store_uri(cfg.tracker.uri))
    exp = client.get_experiment_by_name(cfg.tracker.experiment)
    if exp is None:
        return Decision("train", h)
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`{HASH_TAG}` = '{h}'", max_results=100, order_by=["attributes.start_time DESC"]
    )
    for run in runs:
        if run.info.status == "FINISHED":
            return Decision("skip", h, run_id=run.info.run_id)
    for run in runs:  # newest first: the one that got furthest is usually the last one started
        root = run.data.tags.get("checkpoint_dir")
        if not root or Path(run.data.tags.get("run_dir", "")) == job_dir:
            continue
        # A run that is RUNNING may be alive (another sweep): continue it only if no trainer holds its directory.
        if checkpoint.latest(Path(root)) is not None and not checkpoint.is_locked(Path(root)):
            return Decision("resume", h, run_id=run.info.run_id, checkpoint_dir=root)
    return Decision("train", h)


def finish_job(job_dir: Path, *, mlflow_run_id: str | None, status: str, objective: float | None) -> None:
    """Record how the job ended (rank 0; the other ranks read the objective from here)."""
    record = read_record(job_dir)
    record.update(
        mlflow_run_id=mlflow_run_id,
        status=status,
        objective=None if objective is None or math.isnan(objective) else objective,
    )
    write_json(Path(job_dir) / JOB_FILE, record)


def job_objective(job_dir: Path) -> float:
    """The objective rank 0 recorded for this job (+inf if none), waiting for it on the other ranks."""
    record = _wait_for(job_dir, "status") if rank() != 0 else read_record(job_dir)
    value = record.get("objective")
    return math.inf if value is None else float(value)


def run_job(
    load: Callable[[], RunConfig],
    job_dir: Path,
    train: Callable[[RunConfig], tuple[str | None, list[float]]],
    explain: Callable[[BaseException], str | None],
) -> float:
    """One job of a multirun: decide (:func:`decide`), then skip, continue or train; record how it ended.

    A failing job is reported and recorded, never raised: the sweep goes on with its other jobs, and
    :class:`SweepCallback` fails the sweep at its end if any job failed. A job stopped by a signal
    (``hlat.launch.preempt``: SIGTERM, Ctrl-C, Slurm's warning) is recorded ``preempted`` (or ``interrupted``) and ends
    the sweep: the process exits 85 (or 128 + the signal), and running the same sweep again continues it. (Under Hydra's
    submitit launchers only that job's process ends; ``hlat.sweep.launcher`` collects the other jobs and the sweep
    fails at its end.) A run with no ``tracker.run_name`` is named after the job's swept overrides
    (:func:`default_run_name`).

    Args:
        load: The job's config (the launcher's conversion of Hydra's; a config error fails this job only).
        job_dir: The job's output directory.
        train: Trains ``cfg`` and returns ``(MLflow run id, loss points)`` (the launcher's, in or out
            of process: ``hlat.train.entry``).
        explain: The launcher's one-line report of a failure the user can act on (None: an unexpected crash).

    Returns:
        The job's objective (:func:`objective`); +inf, the worst value for a minimizing sweeper, when the job
        failed, its loss was not finite, or it only planned (``train.dry_run``). Optuna 2 cannot be told NaN.
    """
    from hlat.track.mlflow_store import run_store_uri

    cfg, stopped = None, None
    run_id, losses, status = None, [], "failed"
    try:
        cfg = _named(load(), job_dir)
        if cfg.train.dry_run:  # a plan, no run: nothing to skip, record or compare
            train(cfg)
            return math.inf
        run_id, losses, status = _carry_out(cfg, decide(cfg, job_dir), job_dir, train)
    except (PreemptedError, AbortedError, KeyboardInterrupt) as e:
        stopped, status = e, "preempted" if isinstance(e, PreemptedError) else "interrupted"
        run_id = _recorded_run_id(cfg, job_dir)
    except Exception as e:
        message = explain(e)
        print(message or f"hlat: job {job_dir.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        if message is None:
            log.exception("job %s failed", job_dir.name)
        run_id = _recorded_run_id(cfg, job_dir)
    if stopped is not None:
        _stop(job_dir, stopped, run_id, status)
    if rank() != 0:
        return job_objective(job_dir)
    uri = run_store_uri(cfg.tracker.uri) if cfg is not None and cfg.tracker.kind == "mlflow" else None
    value = objective(uri, run_id, losses) if status != "failed" else math.nan
    finish_job(job_dir, mlflow_run_id=run_id, status=status, objective=value)
    return value if math.isfinite(value) else math.inf


def _carry_out(
    cfg: RunConfig,
    decision: Decision,
    job_dir: Path,
    train: Callable[[RunConfig], tuple[str | None, list[float]]],
) -> tuple[str | None, list[float], str]:
    """Skip, continue or train as ``decision`` says: ``(MLflow run id, loss points, status)``."""
    if decision.action == "skip":
        print(
            f"hlat: skipped {job_dir.name}: this config (hash {decision.config_hash}) already FINISHED as MLflow "
            f"run {decision.run_id} in experiment {cfg.tracker.experiment!r}; tracker.skip_finished=false runs "
            "it again"
        )
        return decision.run_id, [], "skipped"
    if decision.action == "resume":
        log.warning(
            "continuing MLflow run %s, which did not finish, from its checkpoints in %s",
            decision.run_id,
            decision.checkpoint_dir,
        )
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint_dir=decision.checkpoint_dir))
    run_id, losses = train(cfg)
    return run_id, losses, "finished"


def _recorded_run_id(cfg: RunConfig | None, job_dir: Path) -> str | None:
    """The MLflow run id the job's trainer recorded before it stopped or failed (None before its config loaded)."""
    return None if cfg is None else read_job(checkpoint_root(cfg, job_dir)).get("mlflow_run_id")


def _named(cfg: RunConfig, job_dir: Path) -> RunConfig:
    """The job's config with ``tracker.run_name`` set to :func:`default_run_name` where the user set none.

    ``tracker.run_name`` is not hashed (:data:`UNHASHED`): the name changes no skip or continue decision.
    """
    if cfg.tracker.run_name is not None or not (name := default_run_name(job_dir)):
        return cfg
    return dataclasses.replace(cfg, tracker=dataclasses.replace(cfg.tracker, run_name=name))


def _stop(job_dir: Path, e: BaseException, run_id: str | None, status: str) -> NoReturn:
    """A job stopped by a signal: record it (rank 0), say how to continue, end the sweep (85, or 128 + the signal)."""
    import signal

    if rank() == 0:
        finish_job(job_dir, mlflow_run_id=run_id, status=status, objective=None)
    what = str(e) if isinstance(e, (PreemptedError, AbortedError)) else "interrupted (Ctrl-C)"
    print(
        f"hlat: sweep job {job_dir.name} {what}. Run the same sweep command again to continue: finished jobs are "
        "skipped and this one continues from its newest checkpoint, in the same MLflow run",
        file=sys.stderr,
    )
    if isinstance(e, PreemptedError):
        hand_over(e.signum)  # under hydra/launcher=slurm: submitit requeues this job, which then continues
        raise SystemExit(PREEMPTED_EXIT_CODE)
    raise SystemExit(128 + (e.signum if isinstance(e, AbortedError) else signal.SIGINT))
