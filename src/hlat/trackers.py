"""Experiment trackers: MLflow, a console printer, and the progress bar. Rank 0 only.

A tracker receives python values, never tensors: metrics arrive as rows ``(step, {name: value})`` once
per log interval (see ``metrics.MetricsLogger``).
"""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from hlat.config import ConfigError, TrackerConfig

log = logging.getLogger(__name__)

Rows = list[tuple[int, dict[str, float]]]

# MLflow REST limits per log_batch request.
_MAX_METRICS, _MAX_PARAMS, _MAX_PARAM_LEN = 1000, 100, 6000


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


class ProgressBar(NoopTracker):
    """A tqdm bar over optimizer steps with loss, tokens/s and ETA; also a loop hook."""

    def __init__(self, total: int, initial: int = 0) -> None:
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0)

    def __call__(self, state: Any, out: Any) -> None:  # loop hook: advance without touching the device
        self.bar.update(state.step - self.bar.n)

    def log_metrics(self, rows: Rows) -> None:
        _, last = rows[-1]
        if "train/loss" not in last:  # rows of other sources (pre-flight, straggler reports) carry no loss
            return
        self.bar.set_postfix(
            loss=f"{last['train/loss']:.3f}", tok_s=f"{last.get('perf/tokens_per_s', 0):,.0f}", refresh=False
        )

    def finish(self, status: str = "FINISHED") -> None:
        self.bar.close()


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


def default_uri() -> str:
    """A sqlite store ``mlflow.db`` in the working directory (``mlflow ui`` opens it from there)."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


_SERVER_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
"""Default ports of the ``tracker.uri`` schemes whose server :func:`check_reachable` asks."""


def check_reachable(cfg: TrackerConfig, *, rank: int = 0, timeout_s: float = 3.0) -> None:
    """Fail fast, before any data or model is built, when the MLflow store of ``tracker.uri`` cannot be used.

    An http(s) server gets one ``GET /health`` (through the proxies of the environment, as MLflow's requests go)
    and a database server one TCP connect, each of at most ``timeout_s`` seconds where MLflow itself would retry
    for minutes; any HTTP answer counts as reachable. A sqlite file's directory must exist and be writable; a
    ``file:`` store's directory must be (or become) a writable directory. Other schemes (databricks, ...) are left
    to MLflow. Only rank 0 tracks, so only rank 0 checks.

    Raises:
        ConfigError: The server does not answer or the store cannot be written; names ``tracker.uri`` and the fixes.
    """
    if rank != 0 or cfg.kind != "mlflow":
        return
    from urllib.parse import urlsplit

    uri = cfg.uri or default_uri()
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+")[0].lower()  # postgresql+psycopg2 -> postgresql
    shown = uri.replace(f":{parts.password}@", ":***@") if parts.password else uri  # never print a password
    fixes = ("fix tracker.uri, drop it (the local store ./mlflow.db) or use tracker=console" if cfg.uri else
             "run from a writable directory, set tracker.uri to a writable store or use tracker=console")  # fmt: skip
    if scheme in _SERVER_PORTS:
        host, port = parts.hostname or "localhost", parts.port or _SERVER_PORTS[scheme]
        error = _http_error(uri, timeout_s) if scheme.startswith("http") else _connect_error(host, port, timeout_s)
        if error is not None:
            start = f"mlflow server --host {host} --port {port}" if scheme.startswith("http") else "the database"
            raise ConfigError(f"tracker.uri={shown}: nothing answers at {host}:{port} within {timeout_s:g} s "
                              f"({error}); start the server ({start}), {fixes}")  # fmt: skip
        return
    if scheme == "sqlite":
        db = uri.removeprefix("sqlite:///")
        if db in ("", ":memory:") or db == uri:
            return
        problem = _store_dir_problem(Path(db).parent, create=False)
    elif scheme in ("file", ""):
        problem = _store_dir_problem(Path(parts.path if scheme == "file" else uri).expanduser(), create=True)
    else:
        return
    if problem is not None:
        raise ConfigError(f"tracker.uri={uri}: {problem}; {fixes}")


def _http_error(uri: str, timeout_s: float) -> str | None:
    """Why ``GET <uri>/health`` got no HTTP answer at all (None: it got one, whatever its status)."""
    import ssl
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:  # an answer: an auth proxy, an old server without /health
        return None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLError):  # a certificate MLflow may be told to accept: its business
            return None
        return str(getattr(e.reason, "strerror", None) or e.reason)
    except (OSError, ValueError) as e:  # TimeoutError, a reset connection, a malformed URL
        return str(e) or type(e).__name__


def _connect_error(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connect to ``host:port`` failed (None: it succeeded)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _store_dir_problem(where: Path, *, create: bool) -> str | None:
    """Why the local store directory ``where`` cannot be used (None: it can); ``create``: MLflow makes it if absent."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if probe != where and not create:
        return f"the directory {where} does not exist (the sqlite store does not create it)"
    try:  # a real write: permissions, read-only mounts and pseudo filesystems alike
        with tempfile.TemporaryFile(dir=probe, prefix=".hlat-write-test-"):
            pass
    except OSError as e:
        return f"cannot write into {probe} ({e.strerror or e})"
    return None


class MLflowTracker(NoopTracker):
    """Logs to MLflow through ``MlflowClient.log_batch`` from a background thread, so logging never blocks a step.

    ``log_metrics`` only appends to a buffer; the thread sends it every ``flush_every_s`` seconds (at once when
    the buffer reaches a full batch, and on every call when ``flush_every_s`` is 0). One HTTP call per point
    manages ~160 points/s against a server; batches reach ~5,000/s. A failed send is kept and retried at the next
    flush; ``finish`` stops the thread and sends what is left from the caller, where an error is raised.
    """

    def __init__(self, cfg: TrackerConfig, run_name: str, tags: dict[str, str], run_id: str | None = None) -> None:
        from mlflow import MlflowClient  # imported here: mlflow takes ~3 s to import

        self.uri = cfg.uri or default_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        tags = {**tags, "host": socket.gethostname()}
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
            exp = self.client.get_experiment_by_name(cfg.experiment)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
            self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
        self.flush_every_s = cfg.flush_every_s
        self._system = None
        if cfg.system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system = SystemMetricsMonitor(self.run_id, resume_logging=previous is not None,
                                                tracking_uri=self.uri)  # fmt: skip
            self._system.start()
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._background, name="hlat-mlflow-flush", daemon=True)
        self._thread.start()

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
                if old is not None and old != value:
                    self.client.set_tag(self.run_id, f"restart.changed.{key}", f"{old} -> {value}"[:5000])
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

    def flush(self) -> None:
        """Send buffered metrics, at most 1000 per request; unsent ones go back to the buffer on error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for i in range(0, len(pending), _MAX_METRICS):
            try:
                self.client.log_batch(self.run_id, metrics=pending[i : i + _MAX_METRICS])
            except Exception:
                with self._lock:
                    self._pending[:0] = pending[i:]
                raise

    def sync(self) -> bool:
        """Send every buffered metric now, from the caller; a failure is logged, not raised. Returns success.

        Called before a checkpoint is declared complete: a restart from that checkpoint replays only later steps,
        so metrics still waiting in the buffer when the process dies (SIGKILL, a lost node) would leave a hole in
        the run's history that nothing logs again.
        """
        try:
            self.flush()
        except Exception:
            log.warning("MLflow log_batch failed before a checkpoint; the metrics are retried at the next flush",
                        exc_info=True)  # fmt: skip
            return False
        return True

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = "FINISHED") -> None:
        if self._system is not None:
            self._system.finish()
        self._stopping = True
        self._wake.set()
        self._thread.join()
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status)

    def ui_hint(self) -> str:
        """One line telling the user how to open this run."""
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if self.uri.startswith(("http://", "https://")):  # a tracking server: its UI is at the same address
            return f"MLflow run {self.run_id} (experiment {self.experiment_id}): {self.uri.rstrip('/')}/{page}"
        return (
            f"MLflow run {self.run_id} (experiment {self.experiment_id}). Open it with: "
            f"mlflow ui --backend-store-uri {self.uri}  then http://127.0.0.1:5000/{page}"
        )


def build_tracker(
    cfg: TrackerConfig, *, rank: int, run_name: str, tags: dict[str, str], extra: list[Tracker],
    run_id: str | None = None,
) -> tuple[Tracker, MLflowTracker | None]:  # fmt: skip
    """The tracker for this rank (a no-op off rank 0) and the MLflow tracker inside it, if any.

    ``extra`` trackers (progress bar, history) are added on rank 0 only. ``run_id``: the MLflow run of a job being
    resumed, which is continued instead of starting a new one.
    """
    if rank != 0:
        return NoopTracker(), None
    trackers: list[Tracker] = list(extra)
    mlflow_tracker = None
    if cfg.kind == "mlflow":
        mlflow_tracker = MLflowTracker(cfg, run_name, tags, run_id=run_id)
        trackers.append(mlflow_tracker)
    else:
        trackers.append(ConsoleTracker())
    return MultiTracker(trackers), mlflow_tracker
