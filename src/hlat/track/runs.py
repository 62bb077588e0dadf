"""hlat runs read back from MLflow: pick them by experiment, run ids or sweep directory (``select_runs``).

A run's metrics come from its Parquet series (``hlat.track.series``: every step, one file to fetch) and, for runs
without one, from MLflow's metric histories. Used by ``hlat compare`` and the sweeps; mlflow and pyarrow are imported
inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

log = logging.getLogger(__name__)

# The per-step metrics hlat logs (see hlat.track.metrics); train/param_norm only every log interval.
METRIC_KEYS = (
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/param_norm",
    "perf/tokens_per_s",
    "perf/step_time_s",
    "sys/peak_rss_gib",
    "sys/cuda_max_allocated_gib",
)

# MLflow's run statuses (mlflow.entities.RunStatus), for checking ``status`` before it goes into a filter string.
RUN_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")

_SEARCH_PAGE = 1000


class Points(Sequence[tuple[int, float]]):
    """A metric's ``(step, value)`` points in step order, held as two numpy arrays (a 450k-step run: 7 MB a metric)."""

    def __init__(self, steps: Iterable[int] | np.ndarray = (), values: Iterable[float] | np.ndarray = ()) -> None:
        self.steps = np.asarray(steps, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.float64)

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, float]]) -> Points:
        """From ``(step, value)`` pairs."""
        pairs = list(pairs)
        return cls([s for s, _ in pairs], [v for _, v in pairs])

    def __len__(self) -> int:
        return len(self.steps)

    @overload
    def __getitem__(self, i: int) -> tuple[int, float]: ...
    @overload
    def __getitem__(self, i: slice) -> Points: ...
    def __getitem__(self, i: int | slice) -> tuple[int, float] | Points:
        if isinstance(i, slice):
            return Points(self.steps[i], self.values[i])
        return int(self.steps[i]), float(self.values[i])

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(self.steps.tolist(), self.values.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Points({list(self)!r})" if len(self) <= 10 else f"Points(<{len(self)} points>)"


@dataclass
class RunData:
    """One MLflow run, read back: its identity, flattened config and metric histories.

    Attributes:
        run_id: The MLflow run id.
        run_name: The MLflow run name.
        params: Every logged param (the flattened resolved Hydra config), as strings.
        metrics: ``{key: Points}`` sorted by step, for every key in ``METRIC_KEYS`` (empty when the run never
            logged it); ``(step, value)`` lists given here are turned into :class:`Points`.
        status: The run's MLflow status (FINISHED, RUNNING, FAILED, KILLED, ...).
        run_dir: The run's ``run_dir`` tag (its Hydra output directory), or ``None`` when untagged.
        latest: Every metric's latest value (MLflow's: at its highest step), read with the run at no extra cost.
    """

    run_id: str
    run_name: str
    params: dict[str, str]
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    status: str = ""
    run_dir: str | None = None
    latest: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = {k: v if isinstance(v, Points) else Points.of(v) for k, v in self.metrics.items()}

    def series(self, key: str) -> Points:
        """The ``(step, value)`` history of one metric; empty when it was not logged."""
        return self.metrics.get(key, Points())

    def values(self, key: str) -> list[float]:
        """Just the values of one metric's history, in step order."""
        return self.series(key).values.tolist()


# --------------------------------------------------------------------------------------------------- selection


def _check_store_exists(uri: str) -> None:
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


def _search_all(client: Any, experiment_ids: list[str], filter_string: str) -> list[Any]:
    """Every matching run (all result pages), oldest first."""
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs(
            experiment_ids,
            filter_string,
            max_results=_SEARCH_PAGE,
            order_by=["attributes.start_time ASC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _all_experiments(client: Any) -> list[Any]:
    """Every active experiment (all result pages)."""
    experiments: list[Any] = []
    token = None
    while True:
        page = client.search_experiments(max_results=_SEARCH_PAGE, page_token=token)
        experiments.extend(page)
        token = page.token
        if not token:
            return experiments


def history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """One metric's history sorted by step; a step logged twice keeps its latest value."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        prev = by_step.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            by_step[m.step] = (m.timestamp, float(m.value))
    return [(step, by_step[step][1]) for step in sorted(by_step)]


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


def run_series(client: Any, run: Any, keys: list[str]) -> dict[str, Points] | None:
    """``keys`` of the run's Parquet series (``hlat.track.series``), or None when it has none or it is damaged.

    Read from the run's MLflow artifacts, else from the files beside its checkpoints (tag ``checkpoint_dir``) here.
    """
    from hlat.track.series import SERIES_DIR, SeriesError, latest_files, read_files, read_points

    run_id, checkpoints = run.info.run_id, run.data.tags.get("checkpoint_dir")
    local = Path(checkpoints) / SERIES_DIR if checkpoints else None
    try:
        names = latest_files(a.path for a in client.list_artifacts(run_id, SERIES_DIR))
        if names:
            with tempfile.TemporaryDirectory() as tmp, _quiet_downloads():
                points = read_files([Path(client.download_artifacts(run_id, n, tmp)) for n in names], keys)
        elif local is not None and local.is_dir():
            points = read_points(local, keys, run_id=run_id)
        else:
            return None
    except SeriesError as e:
        log.warning("run %s: %s; reading its MLflow histories instead", run_id, e)
        return None
    if not points:
        return None
    return {key: Points(*points[key]) if key in points else Points() for key in keys}


def tail_mean(values: list[float]) -> float:
    """Mean of the last 10% of ``values`` (at least one): the "final loss" of a run, and a sweep's objective."""
    return statistics.fmean(values[-max(1, len(values) // 10) :])


def objective(uri: str | None, run_id: str | None, losses: list[float]) -> float:
    """Mean training loss over the last 10% of the logged points (at least one); NaN without any.

    Read from MLflow when the run is tracked there (the whole run, across restarts and skips alike), else from
    ``losses``, the points this process logged.
    """
    if uri and run_id:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        series = run_series(client, client.get_run(run_id), ["train/loss"])
        if series is not None:
            losses = series["train/loss"].values.tolist()
        else:
            losses = [v for _, v in history(client, run_id, "train/loss")]
    return tail_mean(losses) if losses else math.nan


def _load(client: Any, run: Any) -> RunData:
    info = run.info
    metrics = run_series(client, run, list(METRIC_KEYS))
    if metrics is None:
        metrics = {key: Points.of(history(client, info.run_id, key)) for key in METRIC_KEYS}
    return RunData(
        run_id=info.run_id,
        run_name=info.run_name or info.run_id[:8],
        params=dict(run.data.params),
        metrics=metrics,
        status=info.status,
        run_dir=run.data.tags.get("run_dir"),
        latest=dict(run.data.metrics),
    )


def _under(run_dir: str, root: Path) -> bool:
    """Whether ``run_dir`` is ``root`` or inside it (whole path components: ``sweep/1`` is not under ``sweep/10``)."""
    for candidate in {Path(run_dir).expanduser(), Path(run_dir).expanduser().resolve()}:
        if candidate == root or root in candidate.parents:
            return True
    return False


def select_runs(
    uri: str,
    *,
    experiment: str | None = None,
    run_ids: list[str] | None = None,
    sweep_dir: str | None = None,
    status: str | None = "FINISHED",
) -> list[RunData]:
    """Read the runs to compare from an MLflow tracking store.

    Exactly one selector must be given. Runs picked by experiment or sweep directory come oldest first; explicit
    run ids keep the order given (duplicates dropped).

    Args:
        uri: MLflow tracking URI, e.g. ``sqlite:///mlflow.db``.
        experiment: Name of an MLflow experiment: all of its (active) runs.
        run_ids: Explicit MLflow run ids.
        sweep_dir: A Hydra multirun directory: the runs, in any experiment, whose ``run_dir`` tag is that
            directory or inside it. Relative paths are taken from the working directory.
        status: Keep only runs with this MLflow status; ``None`` keeps every status. Explicitly named runs in
            another status are an error rather than silently dropped.

    Returns:
        The selected runs with their params and metric histories.

    Raises:
        ValueError: When not exactly one selector is given, the store does not exist, or nothing matches.
    """
    given = [
        name
        for name, value in (("experiment", experiment), ("run_ids", run_ids), ("sweep_dir", sweep_dir))
        if value is not None
    ]
    if len(given) != 1:
        what = "none was given" if not given else f"got {' and '.join(given)}"
        raise ValueError(
            f"select runs with exactly one of experiment=, run_ids= or sweep_dir= (--experiment NAME, --runs ID "
            f"[ID ...] or --sweep DIR); {what}"
        )
    if run_ids is not None and not run_ids:
        raise ValueError("run_ids is empty; give at least one MLflow run id (--runs ID [ID ...])")
    if status is not None and status not in RUN_STATUSES:
        raise ValueError(f"unknown run status {status!r}; use one of {', '.join(RUN_STATUSES)}, or None for all")
    _check_store_exists(uri)

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        client = MlflowClient(tracking_uri=uri)
        return _select(client, uri, experiment, run_ids, sweep_dir, status)
    except MlflowException as e:
        raise ValueError(f"cannot read the MLflow store at {uri}: {e.message}; check --uri") from e


def _select(
    client: Any, uri: str, experiment: str | None, run_ids: list[str] | None, sweep_dir: str | None, status: str | None
) -> list[RunData]:
    """The body of ``select_runs`` once the arguments are checked and the client is open."""
    if experiment is not None:
        runs = _runs_of_experiment(client, uri, experiment, status)
    elif run_ids is not None:
        runs = _runs_by_id(client, uri, run_ids, status)
    else:
        assert sweep_dir is not None
        runs = _runs_of_sweep(client, uri, sweep_dir, status)
    return [_load(client, run) for run in runs]


def _status_hint(status: str | None) -> str:
    """The end of a refusal when runs were left out for their status: how to include them."""
    return f"; pass status=None (--all-statuses) to include runs that are not {status}" if status else ""


def _runs_of_experiment(client: Any, uri: str, experiment: str, status: str | None) -> list[Any]:
    """The runs of ``experiment`` in ``status``, oldest first."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in _all_experiments(client))
        raise ValueError(
            f"no MLflow experiment {experiment!r} at {uri}; existing experiments: "
            f"{', '.join(names) or '(none)'}. Check --experiment and --uri"
        )
    runs = _search_all(client, [exp.experiment_id], f"attributes.status = '{status}'" if status else "")
    if not runs:
        total = len(_search_all(client, [exp.experiment_id], ""))
        state = f"no {status} runs ({total} in other states{_status_hint(status)})" if status and total else "no runs"
        raise ValueError(f"MLflow experiment {experiment!r} at {uri} has {state}; check --experiment and --uri")
    return runs


def _runs_by_id(client: Any, uri: str, run_ids: list[str], status: str | None) -> list[Any]:
    """The runs named by ``run_ids``, in the order given (duplicates dropped); all must be in ``status``."""
    from mlflow.exceptions import MlflowException

    runs, missing = [], []
    for run_id in dict.fromkeys(run_ids):
        try:
            runs.append(client.get_run(run_id))
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            missing.append(run_id)
    if missing:
        raise ValueError(
            f"no MLflow run with id {', '.join(missing)} at {uri}; check the ids (the full 32-character run "
            "id, as in the MLflow UI) and --uri"
        )
    wrong = [f"{r.info.run_id} is {r.info.status}" for r in runs if status and r.info.status != status]
    if wrong:
        raise ValueError(f"runs at {uri} not {status}: {', '.join(wrong)}{_status_hint(status)}")
    return runs


def _runs_of_sweep(client: Any, uri: str, sweep_dir: str, status: str | None) -> list[Any]:
    """The runs, in any experiment, of the multirun in ``sweep_dir`` and in ``status``, oldest first."""
    from hlat.track.sweep import recorded_run_ids

    root = Path(sweep_dir).expanduser().resolve()
    experiment_ids = [e.experiment_id for e in _all_experiments(client)]
    candidates = _search_all(client, experiment_ids, "") if experiment_ids else []
    recorded = set(recorded_run_ids(root))  # skipped jobs point at runs of an earlier sweep
    runs = [
        run
        for run in candidates
        if run.info.run_id in recorded or (run.data.tags.get("run_dir") and _under(run.data.tags["run_dir"], root))
    ]
    if not runs:
        raise ValueError(
            f"no MLflow run at {uri} has its run_dir tag under {root}; check --sweep (a Hydra multirun "
            "directory such as multirun/DATE/TIME) and --uri (the store the sweep logged to)"
        )
    kept = [run for run in runs if not status or run.info.status == status]
    if not kept:
        raise ValueError(f"none of the {len(runs)} runs under {root} at {uri} is {status}{_status_hint(status)}")
    return kept
