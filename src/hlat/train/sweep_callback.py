"""The Hydra callback of every multirun (``hydra.callbacks.sweep`` in ``conf/config.yaml``).

At the start of a sweep it opens an MLflow parent run, under which every job's run nests (``hlat.track.sweep``), and
puts hlat's subclass of Hydra's submitit launcher in place of the plugin's (``hlat.train.sweep_launcher``: a job that is
killed or cancelled does not crash the sweep; on Slurm, a cluster without accounting is refused first). At the end it
compares the sweep's runs as ``hlat compare --sweep <dir>`` does (``comparison.md``, ``comparison.png`` in the sweep
directory and on the parent run), gives the parent run the summary of its arms (:func:`summarize`: their losses as
metrics, a linked table as its description, a saved view of the MLflow UI) and fails the sweep (exit 1) if a job
failed, was killed or was stopped, naming the jobs and their logs, closing their MLflow runs and marking the parent
run FAILED (a job failed) or KILLED.
A sweep that ends any other way (Ctrl-C, SIGTERM, a job stopped by a signal: ``hlat.train.preempt``) marks its parent
run KILLED on the way out, never leaving it RUNNING. Only rank 0 acts (under ``torchrun`` every rank runs the sweep).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hlat.track import sweep

if TYPE_CHECKING:
    from hlat.track.runs import RunData

log = logging.getLogger(__name__)


def _uri(config: DictConfig) -> str | None:
    """The sweep's MLflow tracking URI, or None when it does not track to MLflow (or only plans: dry runs)."""
    from hlat.track.trackers import default_uri

    tracker = config.get("tracker", {})
    if tracker.get("kind") != "mlflow" or config.get("train", {}).get("dry_run"):
        return None
    return tracker.get("uri") or default_uri()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals that end a sweep between jobs through ``SystemExit`` (so the parent run is closed on the way out);
during a job the trainer takes them over and stops with a checkpoint (``hlat.train.preempt``)."""


def _exit_on_signal(signum: int, frame: Any) -> None:
    os.write(2, f"hlat: sweep stopped by {signal.Signals(signum).name}\n".encode())
    raise SystemExit(128 + signum)


def _logs(job_dir: Path, record: dict[str, Any]) -> list[str]:
    """Where a job's output is: its ``train.log`` and what its launcher recorded (submitit's stdout and stderr)."""
    return [str(job_dir / "train.log"), *record.get("logs", [])]


def _close_job_runs(uri: str, undone: dict[Path, dict[str, Any]]) -> None:
    """Mark the MLflow runs of jobs that died without closing them (SIGKILL, scancel) KILLED or FAILED.

    Never RUNNING forever; running the sweep again continues them (``hlat.train.sweep_job.decide``), in the same run.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for job_dir, record in undone.items():
        run_id = record.get("mlflow_run_id")
        try:
            if run_id and client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED" if record.get("status") == "failed" else "KILLED")
        except Exception:  # the sweep fails anyway; a run that cannot be closed must not hide why
            log.exception("could not close the MLflow run %s of job %s", run_id, job_dir)


class SweepCallback(Callback):
    """MLflow parent run, comparison report and failure summary of a Hydra multirun."""

    def __init__(self) -> None:
        self._open: tuple[str, str, Path] | None = None
        """(uri, parent run id, sweep dir) from the sweep's start until its parent run is terminated."""
        self._handlers: dict[int, Any] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hlat.train import sweep_launcher

        sweep_launcher.adopt(config)  # the plugin's submitit launchers -> hlat's: a dead job does not crash the sweep
        if config.hydra.launcher.get("_target_") == f"{sweep_launcher.OURS}SlurmLauncher":
            sweep_launcher.require_accounting()  # before the parent run: never a sweep that cannot see a job die
        uri = _uri(config)
        if sweep.rank() != 0 or uri is None:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not (sweep_dir / sweep.SWEEP_FILE).exists():  # else this sweep started before (a restarted launcher)
            self._create_parent(config, uri, sweep_dir)
        self._open = (uri, json.loads((sweep_dir / sweep.SWEEP_FILE).read_text())["parent_run_id"], sweep_dir)
        atexit.register(self._close_interrupted)
        for s in STOP_SIGNALS:
            try:
                self._handlers[s] = signal.signal(s, _exit_on_signal)
            except ValueError:  # not the main thread
                break

    @staticmethod
    def _create_parent(config: DictConfig, uri: str, sweep_dir: Path) -> None:
        """Open the sweep's MLflow parent run and record it in ``sweep.json``."""
        from mlflow import MlflowClient

        from hlat.track.trackers import experiment_id as get_experiment

        client = MlflowClient(tracking_uri=uri)
        name = config.tracker.experiment
        experiment_id = get_experiment(client, name)
        overrides = " ".join(config.hydra.overrides.task)
        run = client.create_run(
            experiment_id,
            run_name=f"sweep {sweep_dir.name}",
            tags={
                "hlat.sweep_dir": str(sweep_dir.resolve()),
                "hlat.sweep_overrides": overrides[:5000],
                "mlflow.note.content": f"Hydra multirun `{config.hydra.job.config_name}` {overrides}"[:5000],
            },
        )
        (sweep_dir / sweep.SWEEP_FILE).write_text(
            json.dumps(
                {
                    "parent_run_id": run.info.run_id,
                    "experiment": name,
                    "uri": uri,
                    "overrides": list(config.hydra.overrides.task),
                },
                indent=2,
            )
            + "\n"
        )
        log.info("sweep %s: MLflow parent run %s in experiment %r", sweep_dir, run.info.run_id, name)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if sweep.rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        records = sweep.job_records(sweep_dir)
        # Not done: failed here, killed or cancelled outside (sweep_launcher records those), stopped by a signal.
        undone = {d: r for d, r in records.items() if r.get("status") not in sweep.DONE}
        counts = {s: sum(r.get("status") == s for r in records.values()) for s in (*sweep.DONE, "failed")}
        counts["killed or stopped"] = len(undone) - counts["failed"]
        print(f"hlat: sweep {sweep_dir}: {len(records)} jobs, " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        parent = (
            json.loads((sweep_dir / sweep.SWEEP_FILE).read_text()) if (sweep_dir / sweep.SWEEP_FILE).exists() else None
        )
        uri = _uri(config)
        if uri is not None:
            _close_job_runs(uri, undone)
        if uri is not None and sweep.recorded_run_ids(sweep_dir):
            self._compare(uri, sweep_dir, parent)
        if parent is not None:
            from mlflow import MlflowClient

            status = "FAILED" if counts["failed"] else "KILLED" if undone else "FINISHED"
            MlflowClient(tracking_uri=uri).set_terminated(parent["parent_run_id"], status)
        self._release()
        if undone:
            jobs = "; ".join(
                f"{d.name} {r.get('status', 'killed')} (logs: {', '.join(_logs(d, r))})" for d, r in undone.items()
            )
            print(
                f"hlat: {len(undone)} of {len(records)} jobs did not finish: {jobs}. Fix the cause and run the same "
                "command again: finished jobs are skipped and the others continue from their newest checkpoint",
                file=sys.stderr,
            )
            raise SystemExit(1)  # Hydra turns a callback's exceptions into warnings; the sweep must fail

    def _release(self) -> None:
        """The sweep ended normally: nothing to close at exit; the signal handlers go back."""
        self._open = None
        for s, handler in self._handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._handlers.clear()

    def _close_interrupted(self) -> None:
        """At exit, if the sweep did not end normally: mark its parent run KILLED (never left RUNNING)."""
        if self._open is None:
            return
        uri, parent_run_id, sweep_dir = self._open
        self._open = None
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            client.set_tag(parent_run_id, "hlat.interrupted", "true")
            client.set_terminated(parent_run_id, "KILLED")
        except Exception:  # exiting anyway: report, never raise from atexit
            log.exception("could not mark the parent run %s of sweep %s KILLED", parent_run_id, sweep_dir)
            return
        print(
            f"hlat: sweep {sweep_dir} interrupted: its MLflow parent run {parent_run_id} is KILLED. Run the same "
            "command again to continue: finished jobs are skipped, the others continue from their checkpoints",
            file=sys.stderr,
        )

    @staticmethod
    def _compare(uri: str, sweep_dir: Path, parent: dict[str, Any] | None) -> None:
        """``hlat compare --sweep`` over this sweep, then :func:`summarize` on its parent run (failures: logged)."""
        from mlflow import MlflowClient

        from hlat.track.compare import summary_table, write_report
        from hlat.track.runs import select_runs
        from hlat.track.trackers import ui_address

        client = MlflowClient(tracking_uri=uri)
        try:
            runs = select_runs(uri, sweep_dir=str(sweep_dir), status=None)
            md, png = write_report(runs, sweep_dir, title=f"Sweep {sweep_dir}: {len(runs)} MLflow runs")
            print(summary_table(runs))
            print(f"\ncomparison: {md}\nplot:       {png}\nagain:      hlat compare --sweep {sweep_dir} --uri {uri}")
            if parent is not None:
                for f in (md, png):
                    client.log_artifact(parent["parent_run_id"], str(f))
        except Exception:
            log.exception("could not compare the runs of sweep %s", sweep_dir)
            return
        if parent is None:
            return
        try:
            page = summarize(client, parent["parent_run_id"], runs, sweep_dir.name)
            print(f"MLflow:     {ui_address(uri, page)}")
        except Exception:  # the UI's conveniences: the sweep and its comparison stand without them
            log.exception("could not summarize sweep %s on its MLflow parent run", sweep_dir)


# ------------------------------------------------------------------------------------------ the parent run's summary

HISTORY_POINTS = 1000
"""At most this many points of each arm's loss go onto the parent run (evenly spaced, the last one kept)."""
VIEW_TAG = "mlflow.sharedViewState."
"""The experiment-tag prefix of the MLflow UI's saved views ("Views" on the runs page), up to 3.17 at least."""


def metric_label(name: str) -> str:
    """A run name as a part of an MLflow metric key.

    ``optimizer.lr=0.001,train.steps=6`` -> ``optimizer.lr_0.001 train.steps_6``: metric keys allow only
    alphanumerics, ``_ - . /`` and spaces (and ``:``, but not on Windows); a ``/`` would start a chart section of
    MLflow's UI.
    """
    text = re.sub(r"[^\w.\- ]", "_", name.replace(",", " ").replace("/", "."))
    return re.sub(r" +", " ", text).strip()[:200]


def arm_labels(runs: Sequence[RunData]) -> list[str]:
    """One distinct :func:`metric_label` per run (a repeated one gets the run id's first 8 characters)."""
    labels = [metric_label(r.run_name).strip(".") or r.run_id[:8] for r in runs]
    return [f"{lb} {r.run_id[:8]}" if labels.count(lb) > 1 else lb for lb, r in zip(labels, runs, strict=True)]


def _thin(points: list[tuple[int, float]], n: int = HISTORY_POINTS) -> list[tuple[int, float]]:
    """At most ``n`` of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= n:
        return points
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


def summary_metrics(runs: Sequence[RunData]) -> list[tuple[str, float, int]]:
    """The parent run's metrics ``(key, value, step)``: its arms' losses.

    So the runs table and the charts of MLflow's UI show the sweep on its parent run, without expanding it.
    Per arm (``<arm>``: :func:`arm_labels`): ``final_loss/<arm>`` (the mean of its last 10% of loss points, as in
    ``comparison.md``), ``min_loss/<arm>`` and ``train_loss/<arm>``, its loss history (at most
    :data:`HISTORY_POINTS` points, at its own steps); and ``sweep/best_final_loss``, the lowest final loss.
    """
    from hlat.track.compare import final_loss, min_loss

    out: list[tuple[str, float, int]] = []
    finals = []
    for run, label in zip(runs, arm_labels(runs), strict=True):
        final, lowest = final_loss(run), min_loss(run)
        if final is None or lowest is None:
            continue
        finals.append(final)
        out += [(f"final_loss/{label}", final, 0), (f"min_loss/{label}", lowest, 0)]
        out += [(f"train_loss/{label}", v, step) for step, v in _thin(run.series("train/loss"))]
    if any(math.isfinite(f) for f in finals):
        out.append(("sweep/best_final_loss", min(f for f in finals if math.isfinite(f)), 0))
    return out


def _note(runs: Sequence[RunData], experiment_id: str, view: str, overrides: str) -> str:
    """The parent run's description (markdown): a link to the sweep's view and a table of its arms, each linked."""
    from hlat.track.compare import final_loss, min_loss
    from hlat.track.trackers import ui_page

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    order = sorted(runs, key=lambda r: (final_loss(r) is None, final_loss(r) or 0.0))
    head = (
        f"Hydra multirun {overrides}\n\n[All {len(runs)} arms: loss curves, parallel coordinates]({view}) "
        "(comparison.md and comparison.png: Artifacts)\n\n"
        "| arm | final loss (last 10%) | min loss | status |\n|---|---:|---:|---|\n"
    )
    rows = [
        f"| [{r.run_name.replace('|', '/')}]({ui_page(experiment_id, r.run_id)}) | {cell(final_loss(r))} | "
        f"{cell(min_loss(r))} | {r.status} |\n"
        for r in order
    ]
    text = head
    for i, row in enumerate(rows):
        if len(text) + len(row) > 7000:  # MLflow's tag values hold 8000 characters
            return text + f"| ... {len(rows) - i} more: comparison.md | | | |\n"
        text += row
    return text


def sweep_view(name: str, runs: Sequence[RunData], parent_run_id: str, now_ms: int) -> str:
    """A saved view of the MLflow UI's runs page (the value of an experiment tag ``mlflow.sharedViewState.<key>``).

    It shows the sweep's arms only (not their parent, so nothing is to be expanded), best final loss first, with
    their swept params and the loss as columns, and charts headed by the loss of every arm, a parallel-coordinates
    plot of the swept params against the loss and the last loss of each arm. The format is the one MLflow 3.17's UI
    writes (``JSON {name, createdAt, updatedAt, state}``, ``state`` a JSON string); a view it cannot read is only
    skipped by it.
    """
    from hlat.track.compare import differing_keys

    ids = [r.run_id for r in runs]
    where = (
        f"attributes.run_id IN ({', '.join(repr(i) for i in ids)})"
        if len(ids) <= 200
        else f"tags.`mlflow.parentRunId` = '{parent_run_id}'"
    )
    params = differing_keys(runs)[:8]
    section = f"hlat{parent_run_id[:12]}s"

    def chart(kind: str, n: int, **fields: Any) -> dict[str, Any]:
        return {
            "uuid": f"hlat{parent_run_id[:12]}c{n}",
            "type": kind,
            "runsCountToCompare": max(10, len(ids)),
            "metricSectionId": section,
            "deleted": False,
            "isGenerated": False,
            **fields,
        }

    line = {
        "lineSmoothness": 0,
        "xAxisScaleType": "linear",
        "scaleType": "linear",
        "range": {},
        "xAxisKey": "step",
        "selectedXAxisMetricKey": "",
        "yAxisKey": "metric",
        "yAxisExpressions": [],
        "ignoreOutliers": False,
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }
    charts = [chart("LINE", 0, displayName="train/loss", metricKey="train/loss", **line)]
    if params:
        charts.append(
            chart(
                "PARALLEL",
                1,
                displayName="swept params and the final loss",
                selectedParams=params,
                selectedMetrics=["train/loss"],
                showAllRuns=True,
            )
        )
    charts.append(chart("BAR", 2, displayName="last train/loss", metricKey="train/loss"))
    state = {
        "searchFilter": where,
        "orderByKey": "metrics.`train/loss`",
        "orderByAsc": True,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": [*(f"params.`{k}`" for k in params), "metrics.`train/loss`"],
        "columnOrder": [],
        "columnWidths": {},
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": section,
                "name": f"sweep {name}",
                "display": True,
                "isReordered": True,
                "deleted": False,
                "isGenerated": False,
            }
        ],
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": True,
        "groupBy": None,
        "groupsExpanded": {},
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
        "chartsSearchFilter": "",
    }
    return json.dumps({"name": f"sweep {name}", "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)})


def summarize(client: Any, parent_run_id: str, runs: Sequence[RunData], name: str) -> str:
    """Give a sweep's parent run the summary of its arms ``runs``.

    That is :func:`summary_metrics`, a description with a linked table of the arms, and a saved view of the UI
    (:func:`sweep_view`, experiment tag ``mlflow.sharedViewState.hlat-<parent run id>``). Each arm gets the colour
    it has in ``comparison.png`` (run tag ``mlflow.runColor``), in the UI's tables and charts too.

    Returns:
        The UI page of that view (``#/experiments/...``; :func:`hlat.track.trackers.ui_address` makes it an address).
    """
    from matplotlib.colors import to_hex
    from mlflow.entities import Metric

    from hlat.track.trackers import ui_page

    experiment_id = client.get_run(parent_run_id).info.experiment_id
    for i, run in enumerate(runs):  # hlat.track.compare.plot's colours, in the same order
        client.set_tag(run.run_id, "mlflow.runColor", to_hex(f"C{i % 10}"))
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, step) for k, v, step in summary_metrics(runs)]
    for i in range(0, len(metrics), 1000):
        client.log_batch(parent_run_id, metrics=metrics[i : i + 1000])
    key = f"hlat-{parent_run_id}"
    client.set_experiment_tag(experiment_id, VIEW_TAG + key, sweep_view(name, runs, parent_run_id, now))
    page = ui_page(experiment_id, viewStateShareKey=key, compareRunsMode="CHART")
    overrides = client.get_run(parent_run_id).data.tags.get("hlat.sweep_overrides", "")
    client.set_tag(parent_run_id, "mlflow.note.content", _note(runs, experiment_id, page, overrides))
    return page
