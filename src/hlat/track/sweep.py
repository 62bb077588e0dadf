"""A sweep's records, identity and grouping: what its jobs wrote, which MLflow runs they are, how to tell them apart.

A job is identified by ``hlat.config_hash`` (the config without :data:`UNHASHED`), recorded in ``sweep_job.json``
(the sweep in ``sweep.json``) and nested under the sweep's parent run. Its objective is read back from MLflow, so a
skipped job reports exactly what its run did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOB_FILE = "sweep_job.json"
"""In each job directory: the job's decision, its MLflow run and, once it ended, its status and objective."""
SWEEP_FILE = "sweep.json"
"""In the sweep directory: the MLflow parent run of the sweep."""
HASH_TAG = "hlat.config_hash"

UNHASHED = frozenset(
    {
        "tracker.name",
        "tracker.run_name",
        "tracker.uri",
        "tracker.plots",
        "tracker.skip_finished",
        "tracker.flush_every_s",
        "tracker.system_metrics",
        "train.checkpoint_dir",
        "train.resume",
        "train.keep_last",
        "train.keep_every",
        "train.async_checkpoint",
        "train.checkpoint_every",
        "train.preempt_grace_s",
        "cluster.max_restarts",
        "data.cache_dir",
        "data.worker",
        "data.prefetch",
        "eval.on_error",
    }
)
"""Config keys that say where output goes or how it is kept, not what is computed: left out of the job hash."""
UNHASHED_GROUPS = ("fault.",)
"""Whole groups left out: injected faults are recovered from bit-identically, so a run with faults (the tests'
way to kill a sweep) computes what the same run without them does."""

DONE = ("finished", "skipped")
"""Job statuses of a job that completed; any other (``failed``, ``killed``, ``preempted``, ``interrupted``, none
recorded) fails the sweep."""


def config_hash(config: dict[str, Any]) -> str:
    """Hash of the resolved run config (``dataclasses.asdict`` of a RunConfig), :data:`UNHASHED` keys left out."""
    from hlat.config import flatten

    kept = {k: v for k, v in flatten(config).items() if k not in UNHASHED and not k.startswith(UNHASHED_GROUPS)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rank() -> int:
    """This process's global rank as a launcher set it (0 for a plain ``python train.py``)."""
    from hlat.config.resolvers import global_rank

    return global_rank()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_record(job_dir: Path) -> dict[str, Any]:
    """The job's ``sweep_job.json``; empty when it has none."""
    path = Path(job_dir) / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else {}


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
    """Record a job that ended without reporting back as ``status`` (``killed``, ``failed``); returns its status.

    A status the job recorded itself (``preempted``, ``interrupted``, ``finished``) is kept.
    """
    record = read_record(job_dir)
    if record.get("status") in (*DONE, "preempted", "interrupted"):
        return record["status"]
    record.update(status=status, reason=reason, logs=logs, objective=None)
    record["mlflow_run_id"] = record.get("mlflow_run_id") or mlflow_run_id
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    write_json(Path(job_dir) / JOB_FILE, record)
    return status


def swept_overrides(job: list[str], command_line: list[str]) -> list[str]:
    """The overrides that tell this job from the other jobs of its sweep, e.g. ``["optimizer.beta2=0.95"]``.

    Those of keys the command line sweeps or does not set (the sweeper's params); the shared, fixed ones are left out.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed = {o.key_or_group for o in parser.parse_overrides(command_line) if not o.is_sweep_override()}
    return [text for text, o in zip(job, parser.parse_overrides(job), strict=True) if o.key_or_group not in fixed]


def default_run_name(job_dir: Path) -> str | None:
    """A sweep job's MLflow run name, its swept overrides joined by ``,`` (None outside a tracked sweep)."""
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
