"""Experiment trackers: MLflow, a console printer (the progress bar: hlat.track.progress). Rank 0 only.

A tracker receives python values, never tensors: metrics arrive as rows ``(step, {name: value})`` once
per log interval (see ``metrics.MetricsLogger``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from hlat.config import TrackerConfig
from hlat.track.mlflow_store import (  # noqa: F401  (re-exported: their home is hlat.track.mlflow_store)
    EXPERIMENT_KIND_TAG,
    LOSS,
    MODEL_TRAINING,
    UI_QUERY,
    check_reachable,
    default_uri,
    experiment_id,
    ui_address,
    ui_page,
)
from hlat.track.progress import ProgressBar  # noqa: F401  (its home is hlat.track.progress; re-exported)

log = logging.getLogger(__name__)

Rows = list[tuple[int, dict[str, float]]]

# MLflow REST limits per log_batch request.
_MAX_METRICS, _MAX_PARAMS, _MAX_PARAM_LEN = 1000, 100, 6000
SYSTEM_SAMPLE_S, SYSTEM_SAMPLES = 30.0, 10
"""MLflow's system metrics: sampled every 30 s, their mean logged every 10 samples (5 min): ~9k points per metric
over a month-long run, where MLflow's default (every 10 s) logs 260k."""
CHANGED_TAG = "restart.changed."
"""Prefix of the tags of a setting a restart changed: ``restart.changed.<key>`` = ``"old -> new"``."""


class Tracker(Protocol):
    """Where a run's configuration, metrics and files go."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Record flat configuration values."""
        ...

    def log_metrics(self, rows: Rows) -> None:
        """Record metric rows, in step order."""
        ...

    def log_artifact(self, path: Path) -> None:
        """Attach a file to the run."""
        ...

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close; ``status`` is FINISHED, FAILED or KILLED."""
        ...


class NoopTracker:
    """Accepts everything, records nothing: what ranks other than 0 get."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, rows: Rows) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


class History(NoopTracker):
    """Keeps the first metric row and the latest ``max_rows`` in memory (end-of-run summary, tests).

    Bounded so that a 450k-step run does not hold every row on the host.
    """

    def __init__(self, max_rows: int = 10_000) -> None:
        self.first: tuple[int, dict[str, float]] | None = None
        self.recent: deque[tuple[int, dict[str, float]]] = deque(maxlen=max_rows)

    @property
    def rows(self) -> Rows:
        """The kept rows in step order."""
        head = [self.first] if self.first is not None and (not self.recent or self.recent[0] is not self.first) else []
        return head + list(self.recent)

    def log_metrics(self, rows: Rows) -> None:
        if self.first is None and rows:
            self.first = rows[0]
        self.recent.extend(rows)

    def series(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of one metric, over the kept rows."""
        return [(step, row[name]) for step, row in self.rows if name in row]


class SeriesRecorder(NoopTracker):
    """Keeps EVERY ``(step, value)`` of a few metrics, for the end-of-run plots.

    16 bytes a point: 5 metrics over a 450k-step run hold about 36 MB.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._steps = {k: array("q") for k in keys}
        self._values = {k: array("d") for k in keys}

    def log_metrics(self, rows: Rows) -> None:
        for step, row in rows:
            for key, steps in self._steps.items():
                if key in row:
                    steps.append(step)
                    self._values[key].append(row[key])

    def series(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of one recorded metric."""
        return list(zip(self._steps[name], self._values[name], strict=True))


class ConsoleTracker(NoopTracker):
    """Prints one line per log interval (without breaking the progress bar)."""

    def log_metrics(self, rows: Rows) -> None:
        step, last = rows[-1]
        text = "  ".join(f"{k}={v:.4g}" for k, v in last.items())
        tqdm.write(f"step {step}: {text}")


class MultiTracker:
    """Fans every call out to several trackers."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log_params(self, params: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, rows: Rows) -> None:
        for t in self.trackers:
            t.log_metrics(rows)

    def log_artifact(self, path: Path) -> None:
        for t in self.trackers:
            t.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        for t in self.trackers:
            t.finish(status)


class MLflowTracker(NoopTracker):
    """Logs to MLflow through ``MlflowClient.log_batch`` from a background thread, so logging never blocks a step.

    Batches, sent every ``flush_every_s``: one HTTP call per point manages ~160 points/s, batches ~5,000/s. A failed
    send is retried at the next flush. A run's first metric is ``train/loss``, which MLflow's compare view then
    charts by default.
    """

    def __init__(self, cfg: TrackerConfig, run_name: str, tags: dict[str, str], run_id: str | None = None) -> None:
        from mlflow import MlflowClient  # imported here: mlflow takes ~3 s to import

        self.uri = cfg.uri or default_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        tags = {**tags, "host": socket.gethostname()}
        self._restart_tags = {k for k in tags if k.startswith(CHANGED_TAG)}
        """The changes the restart itself tagged (since its checkpoint): not overwritten from the first params."""
        self.existing_params: dict[str, str] | None = None
        """The params of a run continued after a restart; None for a new run."""
        previous = self._find(run_id) if run_id else None
        if previous is not None:  # a restarted job continues its own run
            self.run_id, self.experiment_id = previous.info.run_id, previous.info.experiment_id
            self.existing_params = dict(previous.data.params)
            self.client.update_run(self.run_id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
        else:
            self.experiment_id = experiment_id(self.client, cfg.experiment)
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
        self.flush_every_s = cfg.flush_every_s
        self._system: Any = None
        self._system_metrics, self._continued = cfg.system_metrics, previous is not None
        self._loss_sent = previous is not None  # a continued run's metrics are in MLflow's order already
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        if self._loss_sent:
            self._start_system_metrics()
        self._thread = threading.Thread(target=self._background, name="hlat-mlflow-flush", daemon=True)
        self._thread.start()

    def _start_system_metrics(self) -> None:
        """Start MLflow's system metrics monitor (``tracker.system_metrics``), once, unless the run is finishing."""
        if not self._system_metrics:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        with self._lock:
            if self._system is not None or self._stopping:
                return
            self._system = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=SYSTEM_SAMPLE_S,
                samples_before_logging=SYSTEM_SAMPLES,
                resume_logging=self._continued,
                tracking_uri=self.uri,
            )
        self._system.start()

    def _find(self, run_id: str) -> Any:
        """The run ``run_id`` in this store, or None (with a warning) when it is not there."""
        try:
            return self.client.get_run(run_id)
        except Exception:  # MlflowException: another store, or the run was deleted
            log.warning("MLflow run %s of this job is not in %s; starting a new run", run_id, self.uri)
            return None

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        values = {k: str(v)[:_MAX_PARAM_LEN] for k, v in params.items()}
        if self.existing_params is not None:
            # MLflow refuses to change a logged param: a restart that changed one records it as a tag instead.
            for key, value in values.items():
                old = self.existing_params.get(key)
                if old is not None and old != value and CHANGED_TAG + key not in self._restart_tags:
                    self.client.set_tag(self.run_id, CHANGED_TAG + key, f"{old} -> {value}"[:5000])
            values = {k: v for k, v in values.items() if k not in self.existing_params}
        items = [Param(k, v) for k, v in values.items()]
        for i in range(0, len(items), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS])

    def log_metrics(self, rows: Rows) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for step, row in rows for k, v in row.items()]
        with self._lock:
            self._pending.extend(metrics)
            full = len(self._pending) >= _MAX_METRICS
        if full or self.flush_every_s == 0:
            self._wake.set()

    def _background(self) -> None:
        while not self._stopping:
            self._wake.wait(self.flush_every_s or None)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.flush()
            except Exception:  # a server hiccup must not kill the thread; the batch is retried next time
                log.warning("MLflow log_batch failed; retrying at the next flush", exc_info=True)

    def flush(self, *, everything: bool = False) -> None:
        """Send buffered metrics, at most 1000 per request; unsent ones go back to the buffer on error.

        Until the first ``train/loss`` is sent the others wait for it, unless ``everything`` or they fill a batch.
        """
        with self._lock:
            if not self._loss_sent:
                if not everything and len(self._pending) < _MAX_METRICS and all(m.key != LOSS for m in self._pending):
                    return
                self._pending.sort(key=lambda m: m.key != LOSS)  # stable: the losses first, the rest in order
            pending, self._pending = self._pending, []
        for i in range(0, len(pending), _MAX_METRICS):
            try:
                self.client.log_batch(self.run_id, metrics=pending[i : i + _MAX_METRICS])
            except Exception:
                with self._lock:
                    self._pending[:0] = pending[i:]
                raise
        if pending and not self._loss_sent:
            self._loss_sent = True
            self._start_system_metrics()

    def sync(self) -> bool:
        """Send every buffered metric now, from the caller; a failure is logged, not raised. Returns success.

        Called before a checkpoint is declared complete: a restart replays only later steps, so metrics lost with a
        dying process would leave a hole in the history.
        """
        try:
            self.flush(everything=True)
        except Exception:
            log.warning(
                "MLflow log_batch failed before a checkpoint; the metrics are retried at the next flush", exc_info=True
            )
            return False
        return True

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = "FINISHED") -> None:
        with self._lock:
            self._stopping = True  # from here on no system metrics monitor starts
        self._wake.set()
        self._thread.join()
        try:
            if self._system is not None:
                self._system.finish()
            self.flush(everything=True)
        finally:
            self.client.set_terminated(self.run_id, status)

    def ui_hint(self) -> str:
        """One line telling the user how to open this run (in the UI's model-training view)."""
        where = ui_address(self.uri, ui_page(self.experiment_id, self.run_id))
        sep = ":" if self.uri.startswith(("http://", "https://")) else ". Open it with:"
        return f"MLflow run {self.run_id} (experiment {self.experiment_id}){sep} {where}"


def build_tracker(
    cfg: TrackerConfig,
    *,
    rank: int,
    run_name: str,
    tags: dict[str, str],
    extra: list[Tracker],
    run_id: str | None = None,
    thin: Callable[[Tracker], Tracker] | None = None,
) -> tuple[Tracker, MLflowTracker | None]:
    """The tracker for this rank (a no-op off rank 0) and the MLflow tracker inside it, if any.

    ``run_id``: the MLflow run of a resumed job, continued instead of a new one. ``thin``: wraps the MLflow tracker
    (``hlat.track.series.LeanTracker``: what the store keeps per step).
    """
    if rank != 0:
        return NoopTracker(), None
    trackers: list[Tracker] = list(extra)
    mlflow_tracker = None
    if cfg.kind == "mlflow":
        mlflow_tracker = MLflowTracker(cfg, run_name, tags, run_id=run_id)
        trackers.append(thin(mlflow_tracker) if thin is not None else mlflow_tracker)
    else:
        trackers.append(ConsoleTracker())
    return MultiTracker(trackers), mlflow_tracker
