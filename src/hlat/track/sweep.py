"""Resumable Hydra multiruns: skip the jobs that finished, continue the ones that died, group and compare them.

A Hydra multirun (``python train.py -m ...``, any sweeper or launcher) gets from this module:

- **Job identity.** Every run is tagged ``hlat.config_hash``, a hash of the resolved config without the keys that
  only say where things go (:data:`UNHASHED`). When a sweep is run again, a job whose hash matches a FINISHED run
  of the same MLflow experiment is skipped (its objective is read back from MLflow), and a job whose earlier run
  died continues from that run's newest checkpoint, into the same MLflow run. ``tracker.skip_finished=false``
  runs everything again. Single runs (no ``-m``) are never skipped.
- **One decision per job, shared by its ranks.** Rank 0 decides and writes ``<job dir>/sweep_job.json``; the other
  ranks (an external ``torchrun``, Slurm tasks) wait for that file instead of asking MLflow themselves, so they
  cannot disagree. A restarted job reads its own file back and so keeps its decision.
- **A parent run.** :class:`SweepCallback` (``hydra.callbacks`` in ``conf/config.yaml``) opens an MLflow run for
  the sweep, nests every job's run under it (``mlflow.parentRunId``) and, at the end, writes ``hlat compare``'s
  ``comparison.md`` and ``comparison.png`` into the sweep directory and onto the parent run.

The job's objective (what the Optuna sweeper minimizes) is the mean training loss over the last 10% of the
logged points, read from MLflow, so that a skipped job reports exactly what its run reported; a failed or
diverged job scores +inf.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

JOB_FILE = "sweep_job.json"
"""In each job directory: the job's decision, its MLflow run and, once it ended, its status and objective."""
SWEEP_FILE = "sweep.json"
"""In the sweep directory: the MLflow parent run of the sweep."""
HASH_TAG = "hlat.config_hash"

UNHASHED = frozenset({
    "tracker.name", "tracker.run_name", "tracker.uri", "tracker.plots", "tracker.skip_finished",
    "tracker.flush_every_s", "tracker.system_metrics",
    "train.checkpoint_dir", "train.resume", "train.keep_last", "train.keep_every", "train.async_checkpoint",
    "train.checkpoint_every", "train.preempt_grace_s", "cluster.max_restarts", "data.cache_dir", "data.worker",
    "data.prefetch",
})  # fmt: skip
"""Config keys that say where output goes or how it is kept, not what is computed: left out of the job hash."""
UNHASHED_GROUPS = ("fault.",)
"""Whole groups left out: injected faults are recovered from bit-identically, so a run with faults (the tests'
way to kill a sweep) computes what the same run without them does."""

WAIT_S = 600.0
"""How long a rank other than 0 waits for rank 0's decision before giving up."""
DONE = ("finished", "skipped")
"""Job statuses of a job that completed; any other (``failed``, ``killed``, ``preempted``, ``interrupted``, none
recorded) fails the sweep."""


def config_hash(config: dict[str, Any]) -> str:
    """Hash of the resolved run config (``dataclasses.asdict`` of a RunConfig), :data:`UNHASHED` keys left out."""
    from hlat.train.checkpoint import flatten

    kept = {k: v for k, v in flatten(config).items() if k not in UNHASHED and not k.startswith(UNHASHED_GROUPS)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Decision:
    """What a sweep job does: ``train`` (from scratch, or its own checkpoints), ``skip`` or ``resume``."""

    action: str
    config_hash: str
    run_id: str | None = None
    """skip: the FINISHED run of the same config; resume: the run that died and is continued."""
    checkpoint_dir: str | None = None
    """resume: the checkpoint root of that run."""


def rank() -> int:
    """This process's global rank as a launcher set it (0 for a plain ``python train.py``)."""
    from hlat.train.launch import global_rank

    return global_rank()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_record(job_dir: Path) -> dict[str, Any]:
    """The job's ``sweep_job.json``; empty when it has none."""
    path = Path(job_dir) / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else {}


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
    _write_json(job_dir / JOB_FILE, {"decision": dataclasses.asdict(decision)})
    return decision


def _look_up(cfg: Any, h: str, job_dir: Path) -> Decision:
    """Search the experiment for runs of config hash ``h``: a FINISHED one is reused, a dead one continued."""
    from mlflow import MlflowClient

    from hlat.track.trackers import default_uri
    from hlat.train.checkpoint import is_locked, latest

    client = MlflowClient(tracking_uri=cfg.tracker.uri or default_uri())
    exp = client.get_experiment_by_name(cfg.tracker.experiment)
    if exp is None:
        return Decision("train", h)
    runs = client.search_runs([exp.experiment_id], f"tags.`{HASH_TAG}` = '{h}'", max_results=100,
                              order_by=["attributes.start_time DESC"])  # fmt: skip
    for run in runs:
        if run.info.status == "FINISHED":
            return Decision("skip", h, run_id=run.info.run_id)
    for run in runs:  # newest first: the one that got furthest is usually the last one started
        root = run.data.tags.get("checkpoint_dir")
        if not root or Path(run.data.tags.get("run_dir", "")) == job_dir:
            continue
        # A run that is RUNNING may be alive (another sweep): continue it only if no trainer holds its directory.
        if latest(Path(root)) is not None and not is_locked(Path(root)):
            return Decision("resume", h, run_id=run.info.run_id, checkpoint_dir=root)
    return Decision("train", h)


def finish_job(job_dir: Path, *, mlflow_run_id: str | None, status: str, objective: float | None) -> None:
    """Record how the job ended (rank 0; the other ranks read the objective from here)."""
    record = read_record(job_dir)
    record.update(mlflow_run_id=mlflow_run_id, status=status,
                  objective=None if objective is None or math.isnan(objective) else objective)  # fmt: skip
    _write_json(Path(job_dir) / JOB_FILE, record)


def job_objective(job_dir: Path) -> float:
    """The objective rank 0 recorded for this job (+inf if none), waiting for it on the other ranks."""
    record = _wait_for(job_dir, "status") if rank() != 0 else read_record(job_dir)
    value = record.get("objective")
    return math.inf if value is None else float(value)


def objective(uri: str | None, run_id: str | None, losses: list[float]) -> float:
    """Mean training loss over the last 10% of the logged points (at least one); NaN without any.

    Read from MLflow when the run is tracked there (the whole run, across restarts and skips alike), else from
    ``losses``, the points this process logged.
    """
    if uri and run_id:
        from mlflow import MlflowClient

        from hlat.track.runs import history

        losses = [v for _, v in history(MlflowClient(tracking_uri=uri), run_id, "train/loss")]
    from hlat.track.runs import tail_mean

    return tail_mean(losses) if losses else math.nan


def parent_tags(run_dir: Path, experiment: str) -> dict[str, str]:
    """``mlflow.parentRunId`` of the sweep this job belongs to (its ``sweep.json``), if in the same experiment."""
    path = Path(run_dir).parent / SWEEP_FILE
    if not path.exists():
        return {}
    sweep = json.loads(path.read_text())
    if sweep.get("experiment") != experiment:
        return {}
    return {"mlflow.parentRunId": sweep["parent_run_id"], "hlat.sweep_dir": str(Path(run_dir).parent)}


def record_dead_job(job_dir: Path, status: str, reason: str, *, logs: list[str], mlflow_run_id: str | None) -> str:
    """Record a job that ended without reporting back (the launcher's side, ``hlat.train.sweep_launcher``).

    A status the job recorded itself (``preempted`` or ``interrupted`` by a signal, or ``finished`` before its result
    was lost) is kept; otherwise the job is recorded ``status`` (``killed``: cancelled or killed from outside;
    ``failed``) with ``reason``, its logs ``logs`` and its MLflow run, so :class:`SweepCallback` can name it and close
    its run.

    Returns:
        The job's recorded status.
    """
    record = read_record(job_dir)
    if record.get("status") in (*DONE, "preempted", "interrupted"):
        return record["status"]
    record.update(status=status, reason=reason, logs=logs, objective=None)
    record["mlflow_run_id"] = record.get("mlflow_run_id") or mlflow_run_id
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    _write_json(Path(job_dir) / JOB_FILE, record)
    return status


def swept_overrides(job: list[str], command_line: list[str]) -> list[str]:
    """The overrides that tell this job from the other jobs of its sweep, e.g. ``["optimizer.beta2=0.95"]``.

    Args:
        job: The job's overrides (``hydra.overrides.task`` inside the job), as the sweeper normalized them.
        command_line: The sweep's command-line overrides (``optimizer.beta2=0.95,0.99 train.steps=6``).

    Returns:
        The job's overrides of keys the command line sweeps (``a=1,2``, ``range``, ``choice``...) or does not set at
        all (the sweeper's ``hydra.sweeper.params``); the shared, fixed ones are left out.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed = {o.key_or_group for o in parser.parse_overrides(command_line) if not o.is_sweep_override()}
    return [text for text, o in zip(job, parser.parse_overrides(job), strict=True) if o.key_or_group not in fixed]


def default_run_name(job_dir: Path) -> str | None:
    """A sweep job's MLflow run name, its swept overrides joined by ``,`` (None outside a tracked sweep).

    Read from the job's HydraConfig and the sweep's ``sweep.json``, so it is the same under every launcher (the
    basic one, submitit's local processes, Slurm jobs).
    """
    from hydra.core.hydra_config import HydraConfig

    path = Path(job_dir).parent / SWEEP_FILE
    command_line = json.loads(path.read_text()).get("overrides") if path.exists() else None
    if command_line is None or not HydraConfig.initialized():
        return None
    return ",".join(swept_overrides(list(HydraConfig.get().overrides.task), list(command_line))) or None


def job_records(sweep_dir: Path) -> dict[Path, dict[str, Any]]:
    """Every job record under a sweep directory, by job directory."""
    return {p.parent: json.loads(p.read_text()) for p in sorted(Path(sweep_dir).rglob(JOB_FILE))}


def recorded_run_ids(sweep_dir: Path) -> list[str]:
    """The MLflow runs a sweep's jobs trained, continued or reused (skipped jobs point at their earlier run)."""
    ids = []
    for record in job_records(sweep_dir).values():
        run_id = record.get("mlflow_run_id") or record.get("decision", {}).get("run_id")
        if run_id:
            ids.append(run_id)
    return list(dict.fromkeys(ids))


def run_job(hydra_cfg: Any, job_dir: Path, train: Any) -> float:
    """One job of a multirun: decide (:func:`decide`), then skip, continue or train; record how it ended.

    A failing job is reported and recorded, never raised: the sweep goes on with its other jobs, and
    :class:`SweepCallback` fails the sweep at its end if any job failed. A job stopped by a signal (``hlat.train.preempt``:
    SIGTERM, Ctrl-C, Slurm's warning) is recorded ``preempted`` (or ``interrupted``) and ends the sweep: the process
    exits 85 (or 128 + the signal), and running the same sweep again continues it. (Under Hydra's submitit launchers
    only that job's process ends; ``hlat.train.sweep_launcher`` collects the other jobs and the sweep fails at its end.)
    A run with no ``tracker.run_name`` is named after the job's swept overrides (:func:`default_run_name`).

    Args:
        hydra_cfg: The job's composed config.
        job_dir: The job's output directory.
        train: ``hlat.train.run._train``: trains ``(hydra_cfg, cfg)`` and returns ``(MLflow run id, loss points)``.

    Returns:
        The job's objective (:func:`objective`); +inf, the worst value for a minimizing sweeper, when the job
        failed, its loss was not finite, or it only planned (``train.dry_run``). Optuna 2 cannot be told NaN.
    """
    from omegaconf import OmegaConf

    from hlat.track.trackers import default_uri
    from hlat.train.checkpoint import read_job
    from hlat.train.preempt import AbortedError, PreemptedError
    from hlat.train.run import checkpoint_root, error_message, to_run_config

    cfg, stopped = None, None
    run_id, losses, status = None, [], "failed"
    try:
        hydra_cfg, cfg = _named(hydra_cfg, to_run_config(hydra_cfg), job_dir)
        if cfg.train.dry_run:  # a plan, no run: nothing to skip, record or compare
            train(hydra_cfg, cfg)
            return math.inf
        decision = decide(cfg, job_dir)
        if decision.action == "skip":
            print(f"hlat: skipped {job_dir.name}: this config (hash {decision.config_hash}) already FINISHED as MLflow "
                  f"run {decision.run_id} in experiment {cfg.tracker.experiment!r}; tracker.skip_finished=false runs "
                  "it again")  # fmt: skip
            run_id, status = decision.run_id, "skipped"
        else:
            if decision.action == "resume":
                log.warning("continuing MLflow run %s, which did not finish, from its checkpoints in %s",
                            decision.run_id, decision.checkpoint_dir)  # fmt: skip
                hydra_cfg = OmegaConf.merge(hydra_cfg, {"train": {"checkpoint_dir": decision.checkpoint_dir}})
                cfg = to_run_config(hydra_cfg)
            run_id, losses = train(hydra_cfg, cfg)
            status = "finished"
    except (PreemptedError, AbortedError, KeyboardInterrupt) as e:
        stopped, status = e, "preempted" if isinstance(e, PreemptedError) else "interrupted"
        if cfg is not None:
            run_id = read_job(checkpoint_root(cfg, job_dir)).get("mlflow_run_id")
    except Exception as e:
        message = error_message(e)
        print(message or f"hlat: job {job_dir.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        if message is None:
            log.exception("job %s failed", job_dir.name)
        if cfg is not None:
            run_id = read_job(checkpoint_root(cfg, job_dir)).get("mlflow_run_id")
    if stopped is not None:
        _stop(job_dir, stopped, run_id, status)
    if rank() != 0:
        return job_objective(job_dir)
    uri = (cfg.tracker.uri or default_uri()) if cfg is not None and cfg.tracker.kind == "mlflow" else None
    value = objective(uri, run_id, losses) if status != "failed" else math.nan
    finish_job(job_dir, mlflow_run_id=run_id, status=status, objective=value)
    return value if math.isfinite(value) else math.inf


def _named(hydra_cfg: Any, cfg: Any, job_dir: Path) -> tuple[Any, Any]:
    """The job's configs with ``tracker.run_name`` set to :func:`default_run_name` where the user set none.

    ``tracker.run_name`` is not hashed (:data:`UNHASHED`): the name changes no skip or continue decision.
    """
    from omegaconf import OmegaConf

    from hlat.train.run import to_run_config

    if cfg.tracker.run_name is not None or not (name := default_run_name(job_dir)):
        return hydra_cfg, cfg
    hydra_cfg = OmegaConf.merge(hydra_cfg, {"tracker": {"run_name": name}})
    return hydra_cfg, to_run_config(hydra_cfg)


def _stop(job_dir: Path, e: BaseException, run_id: str | None, status: str) -> NoReturn:
    """A job stopped by a signal: record it (rank 0), say how to continue, end the sweep (85, or 128 + the signal)."""
    import signal

    from hlat.train.preempt import PREEMPTED_EXIT_CODE, AbortedError, PreemptedError, hand_over

    if rank() == 0:
        finish_job(job_dir, mlflow_run_id=run_id, status=status, objective=None)
    what = str(e) if isinstance(e, (PreemptedError, AbortedError)) else "interrupted (Ctrl-C)"
    print(f"hlat: sweep job {job_dir.name} {what}. Run the same sweep command again to continue: finished jobs are "
          "skipped and this one continues from its newest checkpoint, in the same MLflow run",
          file=sys.stderr)  # fmt: skip
    if isinstance(e, PreemptedError):
        hand_over(e.signum)  # under hydra/launcher=slurm: submitit requeues this job, which then continues
        raise SystemExit(PREEMPTED_EXIT_CODE)
    raise SystemExit(128 + (e.signum if isinstance(e, AbortedError) else signal.SIGINT))
