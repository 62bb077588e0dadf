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
    open_client,
    run_store_uri,
    ui_address,
    ui_page,
)
from hlat.track.outbox import Outbox, Transport
from hlat.track.progress import ProgressBar  # noqa: F401  (its home is hlat.track.progress; re-exported)
from hlat.track.spool import Spool, latest_steps, spool_path
from hlat.track.system import PREFIX as SYSTEM_PREFIX
from hlat.track.system import SystemSampler

log = logging.getLogger(__name__)

Rows = list[tuple[int, dict[str, float]]]

# MLflow REST limits per log_batch request.
_MAX_PARAMS, _MAX_PARAM_LEN = 100, 6000
SYSTEM_SAMPLE_S, SYSTEM_SAMPLES = 30.0, 10
"""System metrics (:mod:`hlat.track.system`): sampled every 30 s, their mean logged every 10 samples (5 min): ~9k
points per metric over a month-long run, where MLflow's default (every 10 s) logs 260k."""
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
    """Logs to MLflow from a background thread (:mod:`hlat.track.outbox`): nothing waits on the tracking server.

    Batches, sent every ``flush_every_s``: one HTTP call per point manages ~160 points/s, batches ~5,000/s. A failed
    send is retried a few seconds later, never waited for. With a ``spool_dir`` (the trainer's checkpoint directory),
    :meth:`sync` keeps what MLflow does not hold yet in the run's spool file there, and a continued run sends a
    previous attempt's spool first and skips the steps it replays that MLflow already holds (one value per step).
    A run's first metric is ``train/loss``, which MLflow's compare view then charts by default.
    """

    def __init__(
        self,
        cfg: TrackerConfig,
        run_name: str,
        tags: dict[str, str],
        run_id: str | None = None,
        spool_dir: Path | None = None,
    ) -> None:
        self.uri = run_store_uri(cfg.uri)  # command_tracker settled it: tracker.uri, MLFLOW_TRACKING_URI, default
        self.client = open_client(self.uri)  # imports mlflow (~3 s) only now; creates the store once, safely
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
        else:
            self.experiment_id = experiment_id(self.client, cfg.experiment)
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
        self.spool = Spool(spool_path(spool_dir, self.run_id), self.run_id, self.uri) if spool_dir else None
        self.flush_every_s = cfg.flush_every_s
        self._system: SystemSampler | None = None
        self._system_metrics = cfg.system_metrics
        self._stopping = False
        self._lock = threading.Lock()
        self.outbox = Outbox(
            Transport(self.client, self.uri),
            self.run_id,
            cfg.flush_every_s,
            self.spool,
            loss_first=previous is None,  # a continued run's metrics are in MLflow's order already
            on_first_send=self._start_system_metrics,
        )
        if previous is not None:
            self._continue(previous, tags)
        self.outbox.start()

    def _continue(self, previous: Any, tags: dict[str, str]) -> None:
        """A continued run: the previous attempt's tags now, its unsent points first; replayed steps are skipped."""
        stored = latest_steps(previous.data._metric_objs)  # per key, the latest step MLflow holds: one cheap read
        waiting = self.outbox.resume(stored)
        if self.spool is not None:
            tags = {**self.spool.loaded.meta.get("tags", {}), **tags}  # before the restart's own (resumable goes)
            if waiting:
                log.info(
                    "sending first the %d points MLflow did not take before the restart (%s)", waiting, self.spool.path
                )
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        """Start sampling system metrics (``tracker.system_metrics``) into the outbox, once, unless finishing.

        Not MLflow's own monitor: it stops for good at the server's first failed request (:mod:`hlat.track.system`).
        A continued run numbers its points on after those MLflow and the spool hold.
        """
        if not self._system_metrics:
            return
        with self._lock:
            if self._system is not None or self._stopping:
                return
            held = [step for key, step in self.outbox.skip.items() if key.startswith(SYSTEM_PREFIX)]
            self._system = SystemSampler(
                self.outbox.put, max(held, default=-1) + 1, SYSTEM_SAMPLE_S, SYSTEM_SAMPLES, self.uri
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
        self.outbox.put(rows, int(time.time() * 1000))

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tag the run, from the sender thread (kept in the spool while the server is away)."""
        self.outbox.put_tags(tags)

    def sync(self) -> bool:
        """Before a checkpoint is declared complete: every metric up to now is in MLflow or in the spool on disk.

        With a spool this writes and fsyncs a local file, never waits on the server (a restart from the checkpoint
        replays only later steps, so none is missing). Without one it sends from the caller; a failure is logged and
        False returned.
        """
        if self.spool is not None:
            self.outbox.persist()
            return True
        if self.outbox.send(everything=True, points_only=True):
            return True
        log.warning("MLflow log_batch failed before a checkpoint; the metrics are retried at the next flush")
        return False

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Queue ``path`` for the run's artifacts (in folder ``artifact_path``); sent by the outbox, never waited on."""
        self.outbox.put_artifact(str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """Stop the system metrics, send what is left while the store answers; say what it did not take, and where."""
        with self._lock:
            self._stopping = True  # from here on no system metrics monitor starts
        if self._system is not None:  # its last mean goes into the outbox, sent with the rest
            self._system.finish()
        left = self.outbox.close(status)
        if left is not None:
            log.warning("%s", unsent_message(left, self.uri, self.run_id, self.spool.path if self.spool else None))

    def ui_hint(self) -> str:
        """One line telling the user how to open this run (in the UI's model-training view)."""
        where = ui_address(self.uri, ui_page(self.experiment_id, self.run_id))
        sep = ":" if self.uri.startswith(("http://", "https://")) else ". Open it with:"
        return f"MLflow run {self.run_id} (experiment {self.experiment_id}){sep} {where}"


def unsent_message(left: dict[str, Any], uri: str, run_id: str, spool: Path | None) -> str:
    """The one line a run ends with when MLflow did not take everything: how much, of which steps, where it is."""
    parts = [f"{left['points']} points" + (" (steps {}-{})".format(*left["steps"]) if left["steps"] else "")]
    parts += [f"{left[k]} {k if left[k] > 1 else k[:-1]}" for k in ("tags", "artifacts") if left[k]]
    parts += [f"its status {left['status']}"] if left["status"] else []
    lost = f"; {left['dropped']} points beyond the spool's bound are lost" if left["dropped"] else ""
    if spool is None:
        return f"MLflow at {uri} did not take {', '.join(parts)} of run {run_id}; they are lost{lost}"
    return (
        f"MLflow at {uri} did not answer: {', '.join(parts)} of run {run_id} were not sent; they are kept in {spool}"
        f"{lost}. Send them with `hlat track sync {spool}` once it answers (resuming this job also sends them)"
    )


def build_tracker(
    cfg: TrackerConfig,
    *,
    rank: int,
    run_name: str,
    tags: dict[str, str],
    extra: list[Tracker],
    run_id: str | None = None,
    spool_dir: Path | None = None,
    thin: Callable[[Tracker], Tracker] | None = None,
) -> tuple[Tracker, MLflowTracker | None]:
    """The tracker for this rank (a no-op off rank 0) and the MLflow tracker inside it, if any.

    ``run_id``: the MLflow run of a resumed job, continued instead of a new one. ``spool_dir``: where points wait
    while the tracking server is away (the trainer's checkpoint directory). ``thin``: wraps the MLflow tracker
    (``hlat.track.series.LeanTracker``: what the store keeps per step).
    """
    if rank != 0:
        return NoopTracker(), None
    trackers: list[Tracker] = list(extra)
    mlflow_tracker = None
    if cfg.kind == "mlflow":
        mlflow_tracker = MLflowTracker(cfg, run_name, tags, run_id=run_id, spool_dir=spool_dir)
        trackers.append(thin(mlflow_tracker) if thin is not None else mlflow_tracker)
    else:
        trackers.append(ConsoleTracker())
    return MultiTracker(trackers), mlflow_tracker
