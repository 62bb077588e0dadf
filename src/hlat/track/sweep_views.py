"""A sweep's parent run in the MLflow UI: its arms' losses as metrics, a linked table, a saved view of the runs.

:func:`summarize` is what the multirun's callback (``hlat.sweep.callback``) gives the parent run at the end of a
sweep; the rest are its parts (labels, the thinned loss curves, the note, the view's JSON).

May import: ``hlat.config``, the core modules and the rest of ``hlat.track`` (mlflow and matplotlib lazily).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hlat.track.runs import HISTORY_POINTS, thin

if TYPE_CHECKING:
    from hlat.track.runs import RunData

__all__ = ["HISTORY_POINTS", "arm_labels", "metric_label", "summarize", "summary_metrics", "sweep_view", "thin"]

VIEW_TAG = "mlflow.sharedViewState."
"""The experiment-tag prefix of the MLflow UI's saved views ("Views" on the runs page), up to 3.17 at least."""
_LINE_CHART: dict[str, Any] = {
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
"""The settings of the view's loss chart, as MLflow 3.17's UI writes them."""


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


def summary_metrics(runs: Sequence[RunData]) -> list[tuple[str, float, int]]:
    """The parent run's metrics ``(key, value, step)``: its arms' losses.

    So the runs table and the charts of MLflow's UI show the sweep on its parent run, without expanding it.
    Per arm (``<arm>``: :func:`arm_labels`): ``final_loss/<arm>`` (the mean of its last 10% of loss points, as in
    ``comparison.md``), ``min_loss/<arm>`` and ``train_loss/<arm>``, its loss history (at most
    :data:`HISTORY_POINTS` points, at its own steps); and ``sweep/best_final_loss``, the lowest final loss.
    """
    from hlat.track.compare import digest

    out: list[tuple[str, float, int]] = []
    finals = []
    for run, label in zip(runs, arm_labels(runs), strict=True):
        got = digest(run)
        final, lowest = got.final_loss, got.min_loss
        if final is None or lowest is None:
            continue
        finals.append(final)
        out += [(f"final_loss/{label}", final, 0), (f"min_loss/{label}", lowest, 0)]
        out += [(f"train_loss/{label}", v, step) for step, v in got.loss_points]
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
    charts = _view_charts(parent_run_id, section, max(10, len(ids)), params)
    state = _view_state(name, where, params, charts, section)
    return json.dumps({"name": f"sweep {name}", "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)})


def _view_charts(parent_run_id: str, section: str, compared: int, params: list[str]) -> list[dict[str, Any]]:
    """The view's charts: every arm's loss, the swept ``params`` against the loss (if any) and each arm's last loss."""

    def chart(kind: str, n: int, **fields: Any) -> dict[str, Any]:
        return {
            "uuid": f"hlat{parent_run_id[:12]}c{n}",
            "type": kind,
            "runsCountToCompare": compared,
            "metricSectionId": section,
            "deleted": False,
            "isGenerated": False,
            **fields,
        }

    charts = [chart("LINE", 0, displayName="train/loss", metricKey="train/loss", **_LINE_CHART)]
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
    return charts


def _view_state(name: str, where: str, params: list[str], charts: list[dict[str, Any]], section: str) -> dict[str, Any]:
    """The view's ``state``: the arms matching ``where``, best final loss first, ``params`` and the loss as columns."""
    return {
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
