"""hlat runs read back from MLflow: pick them by experiment, run ids or sweep directory (``select_runs``).

A run's metrics come from its Parquet series (``hlat.track.series``: every step, one file to fetch) and, for runs
without one, from MLflow's metric histories. The store is read by ``hlat.track.run_store`` (a local sqlite store
without importing mlflow). Used by ``hlat compare`` and the sweeps; mlflow and pyarrow are imported inside the
functions, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np

if TYPE_CHECKING:
    from hlat.track.run_store import RunStore, StoredRun

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


@dataclass(frozen=True)
class Digest:
    """What a comparison shows of one run, computed once from its full series (:func:`hlat.track.compare.digest`).

    A few thousand numbers however long the run: so ``hlat compare`` and a sweep's summary hold one run's series at
    a time (``select_runs(reduce=digested)``). The figures are ``None`` when the run did not log the metric.

    Attributes:
        final_loss: Mean of the last 10% of the logged loss points (at least one), as the sweep's objective.
        min_loss: Smallest logged loss, ignoring NaN (NaN when every point is NaN).
        grad_norm_median: Median gradient norm over the second half of the logged points.
        param_norm: The last logged parameter norm.
        tokens_per_s: Median of the logged throughput in tokens per second.
        peak_memory_gib: Peak memory of rank 0 in GiB: CUDA's allocated peak where logged, else the peak RSS.
        loss_line: The plotted loss: its moving average of 5 logs, as its envelope (the lowest and highest
            point of each of 1000 step ranges: :func:`hlat.track.compare.plot`).
        grad_norm_line: The plotted gradient norm: its envelope.
        loss_points: The loss at up to :data:`HISTORY_POINTS` evenly spaced logged points, the first and the last kept
            (the curves of a sweep's parent run, ``hlat.track.sweep_views``).
    """

    final_loss: float | None
    min_loss: float | None
    grad_norm_median: float | None
    param_norm: float | None
    tokens_per_s: float | None
    peak_memory_gib: float | None
    loss_line: Points
    grad_norm_line: Points
    loss_points: Points


HISTORY_POINTS = 1000
"""At most this many points of each arm's loss go onto a sweep's parent run (evenly spaced, the last one kept)."""


def thin(points: Sequence[tuple[int, float]], n: int = HISTORY_POINTS) -> Sequence[tuple[int, float]]:
    """At most ``n`` of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= n:
        return points
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


@dataclass
class RunData:
    """One MLflow run, read back: its identity, flattened config and metric histories.

    Attributes:
        run_id: The MLflow run id.
        run_name: The MLflow run name.
        params: Every logged param (the flattened resolved Hydra config), as strings.
        metrics: ``{key: Points}`` sorted by step, for every key read (``METRIC_KEYS`` unless ``select_runs`` was
            given others; empty when the run never logged it); ``(step, value)`` lists given here are turned into
            :class:`Points`.
        status: The run's MLflow status (FINISHED, RUNNING, FAILED, KILLED, ...).
        run_dir: The run's ``run_dir`` tag (its Hydra output directory), or ``None`` when untagged.
        latest: Every metric's latest value (MLflow's: at its highest step), read with the run at no extra cost.
        digest: What ``hlat compare`` shows of the run (:class:`Digest`), once computed; a run
            read with ``select_runs(reduce=hlat.track.compare.digested)`` keeps only it, its ``metrics`` empty.
    """

    run_id: str
    run_name: str
    params: dict[str, str]
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    status: str = ""
    run_dir: str | None = None
    latest: dict[str, float] = field(default_factory=dict)
    digest: Digest | None = None

    def __post_init__(self) -> None:
        self.metrics = {k: v if isinstance(v, Points) else Points.of(v) for k, v in self.metrics.items()}

    def series(self, key: str) -> Points:
        """The ``(step, value)`` history of one metric; empty when it was not logged."""
        return self.metrics.get(key, Points())

    def values(self, key: str) -> list[float]:
        """Just the values of one metric's history, in step order."""
        return self.series(key).values.tolist()


# --------------------------------------------------------------------------------------------------- selection


def run_series(client: Any, run: Any, keys: list[str]) -> dict[str, Points] | None:
    """``keys`` of an MLflow run's Parquet series (``hlat.track.series``), or None when it has none or it is damaged.

    ``client``: an ``MlflowClient``; ``run``: one of its ``Run`` objects.
    """
    from hlat.track.run_store import ClientRuns

    return _series(ClientRuns(client), ClientRuns.stored(run), keys)


def _series(store: RunStore, run: StoredRun, keys: Sequence[str]) -> dict[str, Points] | None:
    """``keys`` of the run's Parquet series, or None when it has none or it is damaged.

    Read from the run's MLflow artifacts, else from the files beside its checkpoints (tag ``checkpoint_dir``) here.
    Only the row groups of ``keys`` are decoded.
    """
    from hlat.track.series import SERIES_DIR, SeriesError, latest_files, read_files, read_points

    checkpoints = run.tags.get("checkpoint_dir")
    local = Path(checkpoints) / SERIES_DIR if checkpoints else None
    try:
        names = latest_files(store.series_names(run))
        if names:
            with store.series_files(run, names) as paths:
                points = read_files(paths, keys)
        elif local is not None and local.is_dir():
            points = read_points(local, keys, run_id=run.run_id)
        else:
            return None
    except SeriesError as e:
        log.warning("run %s: %s; reading its MLflow histories instead", run.run_id, e)
        return None
    if not points:
        return None
    return {key: Points(*points[key]) if key in points else Points() for key in keys}


def tail_mean(values: Sequence[float] | np.ndarray) -> float:
    """Mean of the last 10% of ``values`` (at least one): the "final loss" of a run, and a sweep's objective."""
    return statistics.fmean(values[-max(1, len(values) // 10) :])


def objective(uri: str | None, run_id: str | None, losses: list[float]) -> float:
    """Mean training loss over the last 10% of the logged points (at least one); NaN without any.

    Read from MLflow when the run is tracked there (the whole run, across restarts and skips alike), else from
    ``losses``, the points this process logged.
    """
    if uri and run_id:
        from hlat.track.run_store import open_runs

        with contextlib.closing(open_runs(uri)) as store:
            run = store.get(run_id)
            if run is None:
                raise ValueError(f"no MLflow run with id {run_id} at {uri}")
            series = _series(store, run, ["train/loss"])
            if series is not None:
                losses = series["train/loss"].values.tolist()
            else:
                losses = [v for _, v in store.history(run_id, "train/loss")]
    return tail_mean(losses) if losses else math.nan


def _load(store: RunStore, run: StoredRun, keys: Sequence[str]) -> RunData:
    """One run with ``keys`` of its series (its MLflow histories without one), params and latest values."""
    run = store.details(run)
    metrics = _series(store, run, keys)
    if metrics is None:
        metrics = {key: Points.of(store.history(run.run_id, key)) for key in keys}
    return RunData(
        run_id=run.run_id,
        run_name=run.run_name or run.run_id[:8],
        params=run.params or {},
        metrics=metrics,
        status=run.status,
        run_dir=run.tags.get("run_dir"),
        latest=run.metrics or {},
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
    keys: Sequence[str] = METRIC_KEYS,
    reduce: Callable[[RunData], RunData] | None = None,
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
        keys: The metrics to read (only their part of each series is decoded).
        reduce: Applied to each run as soon as it is read, before the next one is: e.g.
            :func:`hlat.track.compare.digested`, which keeps what a comparison shows and drops the full series, so
            that comparing many long runs holds one run's series at a time.

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
    from hlat.track.run_store import check_store_exists, open_runs

    check_store_exists(uri)

    with contextlib.closing(open_runs(uri)) as store:
        try:
            if experiment is not None:
                runs = _runs_of_experiment(store, uri, experiment, status)
            elif run_ids is not None:
                runs = _runs_by_id(store, uri, run_ids, status)
            else:
                assert sweep_dir is not None
                runs = _runs_of_sweep(store, uri, sweep_dir, status)
            return [(reduce or _same)(_load(store, run, keys)) for run in runs]
        except store.errors as e:
            message = getattr(e, "message", None) or str(e)  # MlflowException's message, sqlite3's text
            raise ValueError(f"cannot read the MLflow store at {uri}: {message}; check --uri") from e


def _same(run: RunData) -> RunData:
    return run


def _status_hint(status: str | None) -> str:
    """The end of a refusal when runs were left out for their status: how to include them."""
    return f"; pass status=None (--all-statuses) to include runs that are not {status}" if status else ""


def _runs_of_experiment(store: RunStore, uri: str, experiment: str, status: str | None) -> list[StoredRun]:
    """The runs of ``experiment`` in ``status``, oldest first."""
    exp_id = store.experiment_id(experiment)
    if exp_id is None:
        names = sorted(store.experiment_names())
        raise ValueError(
            f"no MLflow experiment {experiment!r} at {uri}; existing experiments: "
            f"{', '.join(names) or '(none)'}. Check --experiment and --uri"
        )
    runs = store.search([exp_id], status)
    if not runs:
        total = len(store.search([exp_id], None))
        state = f"no {status} runs ({total} in other states{_status_hint(status)})" if status and total else "no runs"
        raise ValueError(f"MLflow experiment {experiment!r} at {uri} has {state}; check --experiment and --uri")
    return runs


def _runs_by_id(store: RunStore, uri: str, run_ids: list[str], status: str | None) -> list[StoredRun]:
    """The runs named by ``run_ids``, in the order given (duplicates dropped); all must be in ``status``."""
    runs, missing = [], []
    for run_id in dict.fromkeys(run_ids):
        run = store.get(run_id)
        if run is None:
            missing.append(run_id)
        else:
            runs.append(run)
    if missing:
        raise ValueError(
            f"no MLflow run with id {', '.join(missing)} at {uri}; check the ids (the full 32-character run "
            "id, as in the MLflow UI) and --uri"
        )
    wrong = [f"{r.run_id} is {r.status}" for r in runs if status and r.status != status]
    if wrong:
        raise ValueError(f"runs at {uri} not {status}: {', '.join(wrong)}{_status_hint(status)}")
    return runs


def _runs_of_sweep(store: RunStore, uri: str, sweep_dir: str, status: str | None) -> list[StoredRun]:
    """The runs, in any experiment, of the multirun in ``sweep_dir`` and in ``status``, oldest first."""
    from hlat.track.sweep import recorded_run_ids

    root = Path(sweep_dir).expanduser().resolve()
    candidates = store.search(store.experiment_ids(), None)
    recorded = set(recorded_run_ids(root))  # skipped jobs point at runs of an earlier sweep
    runs = [
        run
        for run in candidates
        if run.run_id in recorded or (run.tags.get("run_dir") and _under(run.tags["run_dir"], root))
    ]
    if not runs:
        raise ValueError(
            f"no MLflow run at {uri} has its run_dir tag under {root}; check --sweep (a Hydra multirun "
            "directory such as multirun/DATE/TIME) and --uri (the store the sweep logged to)"
        )
    kept = [run for run in runs if not status or run.status == status]
    if not kept:
        raise ValueError(f"none of the {len(runs)} runs under {root} at {uri} is {status}{_status_hint(status)}")
    return kept
