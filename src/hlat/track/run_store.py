"""Read-only access to the runs of an MLflow store, for ``hlat compare``, the sweeps and their objective.

:func:`open_runs` reads a local sqlite store (``sqlite:///path``) with Python's sqlite3, read-only, in MLflow's own
schema: importing mlflow and opening its store costs ~170 MiB and ~2 s of CPU, more than comparing a 450k-step run
(docs/performance.md). Any other store, and a sqlite file this reader does not know (a table or column missing,
experiments outside MLflow's default workspace), goes through ``MlflowClient``. Both give the same answers
(``tests/unit/test_compare.py`` compares them on a real store). A run's series files are read where they lie when
its artifact location is a local directory, else downloaded by MLflow.

May import: the rest of ``hlat.track`` (``series``, which imports pyarrow, inside functions); mlflow only inside
:class:`ClientRuns`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

_PAGE = 1000
_IN_CHUNK = 500  # run ids per ``IN (...)`` query: below SQLite's smallest variable limit (999)
_SQLITE_COLUMNS = {
    "experiments": {"experiment_id", "name", "lifecycle_stage"},
    "runs": {"run_uuid", "name", "status", "start_time", "lifecycle_stage", "artifact_uri", "experiment_id"},
    "tags": {"key", "value", "run_uuid"},
    "params": {"key", "value", "run_uuid"},
    "latest_metrics": {"key", "value", "is_nan", "run_uuid"},
    "metrics": {"key", "value", "timestamp", "step", "is_nan", "run_uuid"},
}
"""What the sqlite reader reads of MLflow's schema; a store without any of it is read
through ``MlflowClient``."""
_DEFAULT_WORKSPACE = "default"


@dataclass
class StoredRun:
    """One run as a store lists it; ``params`` and ``metrics`` (the latest value of each) once ``details`` read them."""

    run_id: str
    run_name: str | None
    status: str
    tags: dict[str, str]
    artifact_uri: str | None
    params: dict[str, str] | None = None
    metrics: dict[str, float] | None = None


class RunStore(Protocol):
    """What ``hlat.track.runs`` asks of an MLflow store: experiments, runs, their series files and histories."""

    errors: tuple[type[Exception], ...]
    """What a failing store raises (``select_runs`` turns them into one line naming the store)."""

    def experiment_id(self, name: str) -> str | None:
        """The id of experiment ``name`` (deleted or not); None when there is none."""

    def experiment_names(self) -> list[str]:
        """The names of the active experiments."""

    def experiment_ids(self) -> list[str]:
        """The ids of the active experiments."""

    def search(self, experiment_ids: list[str], status: str | None) -> list[StoredRun]:
        """The active runs of ``experiment_ids`` (in ``status``, if given), oldest first (run id on a tie)."""

    def get(self, run_id: str) -> StoredRun | None:
        """Run ``run_id`` whatever its state; None when there is none."""

    def details(self, run: StoredRun) -> StoredRun:
        """``run`` with its params and latest metric values."""

    def series_names(self, run: StoredRun) -> list[str]:
        """The artifact paths of the run's series files (``series/<name>``)."""

    def series_files(self, run: StoredRun, names: list[str]) -> contextlib.AbstractContextManager[list[Path]]:
        """Local paths of ``names`` while the context lasts (downloaded into a temporary directory if need be)."""

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """One metric's history sorted by step; a step logged twice keeps its latest value."""

    def close(self) -> None:
        """Let go of the store (a sqlite connection)."""


def check_store_exists(uri: str) -> None:
    """Refuse a local store that does not exist: MLflow would silently create an empty one there."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :].split("?", 1)[0]
        if path and path != ":memory:" and not Path(path).expanduser().exists():
            raise ValueError(
                f"no MLflow store at {uri} ({Path(path).expanduser().resolve()} does not exist); run from the "
                "directory holding mlflow.db or pass its tracking URI (--uri sqlite:///path/to/mlflow.db)"
            )
    elif "://" not in uri or uri.startswith("file:"):
        path = uri[len("file://") :] if uri.startswith("file://") else uri.removeprefix("file:")
        if not Path(path).expanduser().exists():
            raise ValueError(f"no MLflow store at {uri} (the directory does not exist); pass the right --uri")


def open_runs(uri: str) -> RunStore:
    """The reader of store ``uri``: :class:`SqliteRuns` for a sqlite file it knows, else :class:`ClientRuns`.

    Raises:
        ValueError: MLflow cannot open ``uri``.
    """
    if (path := _sqlite_path(uri)) is not None:
        try:
            return SqliteRuns(path)
        except _UnknownStoreError:
            pass
    return ClientRuns.open(uri)


def latest_history(rows: Iterable[tuple[int, int, float]]) -> list[tuple[int, float]]:
    """``(step, timestamp, value)`` rows in MLflow's history order -> ``(step, value)`` by step, the latest per step."""
    by_step: dict[int, tuple[int, float]] = {}
    for step, timestamp, value in rows:
        prev = by_step.get(step)
        if prev is None or timestamp >= prev[0]:
            by_step[step] = (timestamp, float(value))
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def local_dir(artifact_uri: str | None) -> Path | None:
    """The local directory of an artifact location (a path or ``file:`` URI); None for a remote one."""
    if not artifact_uri:
        return None
    parts = urlsplit(artifact_uri)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    return None if parts.scheme else Path(artifact_uri)


def _local_series(run: StoredRun) -> list[str] | None:
    """The run's series artifact paths read from its local artifact directory; None when its artifacts are remote."""
    from hlat.track.series import SERIES_DIR

    root = local_dir(run.artifact_uri)
    if root is None:
        return None
    folder = root / SERIES_DIR
    return sorted(f"{SERIES_DIR}/{p.name}" for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


# --------------------------------------------------------------------------------------------------- sqlite


class _UnknownStoreError(Exception):
    """A sqlite file the reader does not know: MLflow's client reads it."""


def _sqlite_path(uri: str) -> Path | None:
    """The file of a plain ``sqlite:///path`` URI (no query, not in memory); None for any other URI."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    path = uri[len("sqlite:///") :]
    return Path(path) if path and path != ":memory:" else None


class SqliteRuns:
    """A local sqlite MLflow store read with sqlite3 (read-only; MLflow's answers, see the module's docstring)."""

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        if not path.is_file() or os.environ.get("MLFLOW_ENABLE_WORKSPACES", "").lower() in ("1", "true"):
            raise _UnknownStoreError
        try:
            self.db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error as e:
            raise _UnknownStoreError from e
        try:
            columns = {t: {r[1] for r in self.db.execute(f"PRAGMA table_info({t})")} for t in _SQLITE_COLUMNS}
            if any(not need <= columns[t] for t, need in _SQLITE_COLUMNS.items()):
                raise _UnknownStoreError
            self._workspace = "workspace" in columns["experiments"]
            if self._workspace and self._one("SELECT 1 FROM experiments WHERE workspace != ?", _DEFAULT_WORKSPACE):
                raise _UnknownStoreError  # MLflow's own client refuses such a store unless workspaces are enabled
        except (
            _UnknownStoreError,
            sqlite3.Error,
        ) as e:  # not a database, locked too long: MLflow's client says what is wrong
            self.db.close()
            raise _UnknownStoreError from e
        self._mlflow: ClientRuns | None = None
        self._uri = f"sqlite:///{path}"

    def _one(self, sql: str, *args: Any) -> Any:
        row = self.db.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def _experiments(self, where: str, *args: Any) -> list[tuple[str, str]]:
        if self._workspace:
            where, args = f"({where}) AND workspace = ?", (*args, _DEFAULT_WORKSPACE)
        rows = self.db.execute(f"SELECT experiment_id, name FROM experiments WHERE {where}", args)
        return [(str(i), n) for i, n in rows]

    def experiment_id(self, name: str) -> str | None:
        found = self._experiments("name = ?", name)
        return found[0][0] if found else None

    def experiment_names(self) -> list[str]:
        return [n for _, n in self._experiments("lifecycle_stage = 'active'")]

    def experiment_ids(self) -> list[str]:
        return [i for i, _ in self._experiments("lifecycle_stage = 'active'")]

    _RUN = "SELECT run_uuid, name, status, artifact_uri FROM runs"

    def search(self, experiment_ids: list[str], status: str | None) -> list[StoredRun]:
        if not experiment_ids:
            return []
        where = f"experiment_id IN ({','.join('?' * len(experiment_ids))}) AND lifecycle_stage = 'active'"
        args: list[Any] = [int(i) for i in experiment_ids]
        if status is not None:
            where, args = f"{where} AND status = ?", [*args, status]
        order = "ORDER BY start_time IS NULL, start_time, run_uuid"  # MLflow's order for start_time ASC
        return self._runs(self.db.execute(f"{self._RUN} WHERE {where} {order}", args).fetchall())

    def get(self, run_id: str) -> StoredRun | None:
        runs = self._runs(self.db.execute(f"{self._RUN} WHERE run_uuid = ?", (run_id,)).fetchall())
        return runs[0] if runs else None

    def _runs(self, rows: list[tuple[str, str | None, str, str | None]]) -> list[StoredRun]:
        tags = self._by_run("SELECT run_uuid, key, value FROM tags", [r[0] for r in rows])
        return [StoredRun(i, name, status, tags.get(i, {}), uri) for i, name, status, uri in rows]

    def _by_run(self, select: str, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{run id: {key: value}}`` of ``select`` (``run_uuid, key, value``) for ``run_ids``."""
        out: dict[str, dict[str, Any]] = {}
        for lo in range(0, len(run_ids), _IN_CHUNK):
            chunk = run_ids[lo : lo + _IN_CHUNK]
            for run_id, key, value in self.db.execute(
                f"{select} WHERE run_uuid IN ({','.join('?' * len(chunk))})", chunk
            ):
                out.setdefault(run_id, {})[key] = value
        return out

    def details(self, run: StoredRun) -> StoredRun:
        if run.params is None:
            run.params = self._by_run("SELECT run_uuid, key, value FROM params", [run.run_id]).get(run.run_id, {})
            latest = "SELECT run_uuid, key, CASE WHEN is_nan THEN NULL ELSE value END FROM latest_metrics"
            values = self._by_run(latest, [run.run_id]).get(run.run_id, {})
            run.metrics = {k: float("nan") if v is None else float(v) for k, v in values.items()}
        return run

    def series_names(self, run: StoredRun) -> list[str]:
        local = _local_series(run)
        return local if local is not None else self._client().series_names(run)

    def series_files(self, run: StoredRun, names: list[str]) -> contextlib.AbstractContextManager[list[Path]]:
        root = local_dir(run.artifact_uri)
        if root is None:
            return self._client().series_files(run, names)
        return contextlib.nullcontext([root / n for n in names])

    def _client(self) -> ClientRuns:
        """MLflow's client, for the artifacts of a run kept elsewhere (a server's, S3)."""
        if self._mlflow is None:
            self._mlflow = ClientRuns.open(self._uri)
        return self._mlflow

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        value = "CASE WHEN is_nan THEN NULL ELSE value END"
        where = "run_uuid = ? AND key = ? ORDER BY timestamp, step, value"  # MLflow's order: the latest value wins
        rows = self.db.execute(f"SELECT step, timestamp, {value} FROM metrics WHERE {where}", (run_id, key))
        return latest_history((s, t, float("nan") if v is None else v) for s, t, v in rows)

    def close(self) -> None:
        self.db.close()


# --------------------------------------------------------------------------------------------------- MLflow


class ClientRuns:
    """Any MLflow store, through ``MlflowClient``."""

    def __init__(self, client: Any) -> None:
        from mlflow.exceptions import MlflowException

        self.client = client
        self.errors = (MlflowException,)

    @classmethod
    def open(cls, uri: str) -> ClientRuns:
        """A client on ``uri``.

        Raises:
            ValueError: MLflow cannot open it.
        """
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        try:
            return cls(MlflowClient(tracking_uri=uri))
        except MlflowException as e:
            raise ValueError(f"cannot read the MLflow store at {uri}: {e.message}; check --uri") from e

    @staticmethod
    def stored(run: Any) -> StoredRun:
        """An MLflow ``Run`` as a :class:`StoredRun` (with its params and latest values)."""
        info, data = run.info, run.data
        return StoredRun(
            info.run_id,
            info.run_name,
            info.status,
            dict(data.tags),
            info.artifact_uri,
            dict(data.params),
            dict(data.metrics),
        )

    def _pages(self, search: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Every result of a paged MLflow search."""
        found: list[Any] = []
        token = None
        while True:
            page = search(*args, max_results=_PAGE, page_token=token, **kwargs)
            found.extend(page)
            token = page.token
            if not token:
                return found

    def experiment_id(self, name: str) -> str | None:
        exp = self.client.get_experiment_by_name(name)
        return None if exp is None else exp.experiment_id

    def experiment_names(self) -> list[str]:
        return [e.name for e in self._pages(self.client.search_experiments)]

    def experiment_ids(self) -> list[str]:
        return [e.experiment_id for e in self._pages(self.client.search_experiments)]

    def search(self, experiment_ids: list[str], status: str | None) -> list[StoredRun]:
        if not experiment_ids:
            return []
        where = f"attributes.status = '{status}'" if status else ""
        runs = self._pages(self.client.search_runs, experiment_ids, where, order_by=["attributes.start_time ASC"])
        return [self.stored(r) for r in runs]

    def get(self, run_id: str) -> StoredRun | None:
        from mlflow.exceptions import MlflowException

        try:
            return self.stored(self.client.get_run(run_id))
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None

    def details(self, run: StoredRun) -> StoredRun:
        return run

    def series_names(self, run: StoredRun) -> list[str]:
        from hlat.track.series import SERIES_DIR

        local = _local_series(run)
        return local if local is not None else [a.path for a in self.client.list_artifacts(run.run_id, SERIES_DIR)]

    @contextlib.contextmanager
    def series_files(self, run: StoredRun, names: list[str]) -> Iterator[list[Path]]:
        root = local_dir(run.artifact_uri)
        if root is not None:
            yield [root / n for n in names]
            return
        with tempfile.TemporaryDirectory() as tmp, _quiet_downloads():
            yield [Path(self.client.download_artifacts(run.run_id, n, tmp)) for n in names]

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return latest_history([(m.step, m.timestamp, m.value) for m in self.client.get_metric_history(run_id, key)])

    def close(self) -> None:
        pass  # MLflow's client holds nothing to let go of


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No MLflow download progress bar inside (it would interleave with ``hlat compare``'s table)."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    saved = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
