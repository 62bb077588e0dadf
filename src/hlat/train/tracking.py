"""A run's tracking, opened once the model is built: its tags, params and provenance, the tracker, the throughput model.

Rank 0 alone writes and tracks; every rank gets a tracker (a no-op one elsewhere), so training never asks its rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlat import checkpoint
from hlat.backends.base import Env
from hlat.config import RunConfig, flatten, to_yaml
from hlat.health.preflight import log_preflight
from hlat.launch import preempt
from hlat.sizing import bytes_per_param, flops_per_token
from hlat.track import sweep
from hlat.track.metrics import SpikeDetector, Throughput, first_peak_hint, resolve_peak_flops
from hlat.track.progress import ProgressBar
from hlat.track.provenance import write_provenance
from hlat.track.series import SERIES_DIR, LeanTracker, SeriesError, SeriesWriter, store_every
from hlat.track.series_only import SeriesOnly
from hlat.track.trackers import CHANGED_TAG, History, MLflowTracker, SeriesRecorder, Tracker, build_tracker
from hlat.train.resume import JobStart

log = logging.getLogger(__name__)

PLOTTED = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr", "spike/active")
"""The series kept in memory for the end-of-run plots."""
SPOOL_DIR = "mlflow-spool"
"""The checkpoint directory's folder of MLflow spools: the metrics the tracking server has not taken yet."""


@dataclass
class Tracking:
    """Where a run's numbers go: the tracker every rank logs to and what rank 0 keeps for its report."""

    tracker: Tracker
    """The fan-out tracker (MLflow or the console, plus the in-memory sinks below)."""
    mlflow: MLflowTracker | None
    run_id: str | None
    """The MLflow run (a restart continues it), or None without MLflow."""
    history: History
    recorder: SeriesRecorder
    progress: ProgressBar | None
    throughput: Throughput
    series: SeriesWriter | None = None
    """Every point at full resolution as Parquet beside the checkpoints (rank 0; None elsewhere)."""

    def _plotted(self) -> dict[str, list[tuple[int, float]]]:
        """The plotted metrics of the whole job (its Parquet series, if kept here in full), else this process's."""
        try:
            whole = self.series.whole(PLOTTED) if self.series is not None else None
        except SeriesError as e:
            log.warning("plotting this process's points only: %s", e)
            whole = None
        if whole is None:
            return {k: self.recorder.series(k) for k in PLOTTED}
        return {k: list(zip(*(a.tolist() for a in whole[k]), strict=True)) for k in PLOTTED if k in whole}

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` is being made: the series up to it is written (a restart continues from there)."""
        if self.series is not None:
            self.series.checkpoint(step)

    def plot(self, spikes: SpikeDetector, out_dir: Path) -> None:
        """End-of-run plots as artifacts; a plotting failure is logged, never fails a finished run."""
        from hlat.track.plots import training_plots

        try:
            for f in training_plots(self._plotted(), spikes.histogram(), out_dir):
                self.tracker.log_artifact(f)
        except Exception:  # the run itself succeeded; losing a plot must not change that
            log.exception("could not write the end-of-run plots to %s", out_dir)


def start(
    cfg: RunConfig,
    run_dir: Path,
    job: JobStart,
    env: Env,
    backend: str,
    n_params: int,
    first_step: int,
    saved_run_id: str | None,
    uptime_state: dict,
    data_info: dict[str, Any] | None = None,
) -> Tracking:
    """Open the run's tracker with its tags and params; record the MLflow run in the job record (rank 0).

    ``saved_run_id``: the MLflow run a restart continues; ``uptime_state`` is recorded with it. ``data_info``: what
    the loader records of its data (``Loader.run_info``: a mixture's tags, params and plan file).
    """
    data_info = data_info or {}
    t = cfg.train
    progress = ProgressBar(t.steps, first_step, every=t.progress_every or t.log_every) if env.rank == 0 else None
    tags = _tags(cfg, run_dir, job, backend, env.bf16_matmul)
    throughput, peak_source = _throughput(cfg, n_params, env.world_size, env.bf16_matmul)
    tags["perf.peak_source"] = peak_source
    tags |= data_info.get("tags", {})
    derived = {
        **data_info.get("params", {}),
        "perf.flops_per_token": throughput.flops_per_token,
        "perf.flops_per_token_causal": throughput.flops_per_token_causal,
        "perf.peak_tflops": throughput.peak_flops / 1e12 if throughput.peak_flops else None,
    }
    history, recorder = History(), SeriesRecorder(PLOTTED)
    series = SeriesWriter(job.root, first_step) if env.rank == 0 else None
    extra = [history, recorder] + ([series] if series else []) + ([progress] if progress else [])
    spool_dir = job.root / SPOOL_DIR
    # MLflow gets the loss and grad norm every step, the rest thinned to a fixed budget per run, and of a mixture of
    # more than data.log_sources sources only the largest sources' series; the Parquet series has all.
    lean = functools.partial(LeanTracker, every=store_every(t.steps, t.log_every), first_step=first_step)
    hidden = data_info.get("series_only") or None
    thin = lean if hidden is None else lambda mlflow: lean(SeriesOnly(mlflow, **hidden))
    tracker, mlflow_tracker = _open(cfg, run_dir, tags, env.rank, extra, derived, saved_run_id, spool_dir, thin)
    run_id = mlflow_tracker.run_id if mlflow_tracker else saved_run_id
    if series is not None and mlflow_tracker is not None:
        client, mlflow_run = mlflow_tracker.client, mlflow_tracker.run_id
        upload = functools.partial(mlflow_tracker.log_artifact, artifact_path=SERIES_DIR)  # by the outbox: no wait
        series.upload_with(upload, mlflow_run, _series_logged(client, mlflow_run) if first_step else [])
    if env.rank == 0:
        for name, text in data_info.get("files", {}).items():  # the mixture's plan
            (run_dir / name).write_text(text)
            tracker.log_artifact(run_dir / name)
        checkpoint.write_job(job.root, {"mlflow_run_id": run_id, "uptime": uptime_state})
        preempt.unmark(run_dir, mlflow_tracker)  # a preempted run that continues is no longer waiting to resume
    if throughput.peak_flops is None and env.rank == 0 and first_peak_hint(peak_source, cfg.data.cache_dir):
        log.info("no MFU metric: %s (said once per host; the run's tag perf.peak_source keeps it)", peak_source)
    return Tracking(tracker, mlflow_tracker, run_id, history, recorder, progress, throughput, series)


def _series_logged(client: Any, run_id: str) -> list[str]:
    """The series files a continued run has in MLflow (its next part numbers on); empty if they cannot be listed."""
    try:
        return [a.path for a in client.list_artifacts(run_id, SERIES_DIR)]
    except Exception as e:  # a server hiccup: the next part may reuse a number, readers then see the newer file
        log.warning("could not list run %s's metric series in MLflow (%s)", run_id, e)
        return []


def log_health(tracking: Tracking, health: Any, env: Env, run_dir: Path) -> None:
    """The pre-flight check's report into the run (rank 0; ``health`` None: the check did not run)."""
    if health is not None and env.rank == 0:
        log_preflight(health, tracking.tracker, run_dir / "health" / "preflight.md")


def _tags(cfg: RunConfig, run_dir: Path, job: JobStart, backend: str, bf16_matmul: str | None) -> dict[str, str]:
    """The run's tags: backend, bf16 policy, where it writes, its sweep identity and what it started from."""
    tags = {
        "backend": backend,
        "precision.bf16_matmul": bf16_matmul or "n/a",  # the policy that ran; n/a: no bf16 matmuls
        "run_dir": str(run_dir),
        "checkpoint_dir": str(job.root),
        sweep.HASH_TAG: sweep.config_hash(dataclasses.asdict(cfg)),
        **sweep.parent_tags(run_dir, cfg.tracker.experiment),
    }
    if job.resume_from is not None:
        tags["resumed_from"] = str(job.resume_from)
        # What this restart changed since its checkpoint (a new TP degree, precision.master_weights ...).
        tags |= {f"{CHANGED_TAG}{k}": v[:5000] for k, v in job.changed.items()}
    elif cfg.train.init_from:
        tags["init_from"] = str(cfg.train.init_from)
    return tags


def _open(
    cfg: RunConfig,
    run_dir: Path,
    tags: dict[str, str],
    rank: int,
    extra: list,
    derived: dict[str, Any],
    run_id: str | None,
    spool_dir: Path,
    thin: Callable[[Tracker], Tracker],
) -> tuple:
    """Write provenance into ``run_dir``, open the tracker, log params (config + ``derived``) and provenance files.

    ``spool_dir``: where metrics wait while the tracking server is away (beside the checkpoints they belong to).
    ``thin``: wraps the MLflow tracker (the lean store, :class:`~hlat.track.series.LeanTracker`, and a large
    mixture's :class:`~hlat.track.series_only.SeriesOnly`).
    """
    prov_tags, files = write_provenance(run_dir, to_yaml(cfg)) if rank == 0 else ({}, [])
    run_name = cfg.tracker.run_name or f"{cfg.model.name}-{cfg.precision.name}"
    tracker, mlflow_tracker = build_tracker(
        cfg.tracker,
        rank=rank,
        run_name=run_name,
        tags={**prov_tags, **tags},
        extra=extra,
        run_id=run_id,
        spool_dir=spool_dir,
        thin=thin,
    )
    params = flatten(dataclasses.asdict(cfg))
    tracker.log_params(params | bytes_per_param(cfg.precision).as_params() | derived)
    for f in files:
        tracker.log_artifact(f)
    return tracker, mlflow_tracker


def _throughput(cfg: RunConfig, n_params: int, world_size: int, bf16_matmul: str | None) -> tuple[Throughput, str]:
    """FLOPs per token of this model and sequence length, the run's peak FLOP/s and cost per hour."""
    m = cfg.model
    per_token = functools.partial(
        flops_per_token, n_params, m.vocab_size * m.dim, m.n_layers, m.n_heads, m.head_dim, cfg.train.seq_len
    )
    peak, source = resolve_peak_flops(cfg.cluster, cfg.precision.compute_dtype, cfg.data.cache_dir, bf16_matmul)
    nodes = -(-world_size // cfg.cluster.devices_per_node)
    price = cfg.cluster.price_per_hour
    return Throughput(
        flops_per_token=per_token(causal=False),
        flops_per_token_causal=per_token(causal=True),
        peak_flops=peak * world_size if peak else None,
        cost_per_hour=price * nodes if price is not None else None,
    ), source
