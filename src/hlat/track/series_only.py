"""What a run keeps in its Parquet series only: the MLflow tracker without some metrics and params.

A data mixture of more sources than ``data.log_sources`` gives MLflow the series of the largest sources and their sum
``other``; every source's series stays in the run's Parquet series (``hlat.track.series``), which MLflow holds as an
artifact, and its plan in ``mixture_plan.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hlat.track.trackers import Rows, Tracker


class SeriesOnly:
    """Passes everything to ``inner`` but the metric keys ``metrics`` and the params under the ``params`` prefixes."""

    def __init__(self, inner: Tracker, metrics: list[str], params: list[str]) -> None:
        self.inner, self.metrics, self.params = inner, frozenset(metrics), tuple(params)

    def log_params(self, params: dict[str, Any]) -> None:
        self.inner.log_params({k: v for k, v in params.items() if not k.startswith(self.params)})

    def log_metrics(self, rows: Rows) -> None:
        kept = [(step, {k: v for k, v in row.items() if k not in self.metrics}) for step, row in rows]
        if kept := [(step, row) for step, row in kept if row]:
            self.inner.log_metrics(kept)

    def log_artifact(self, path: Path) -> None:
        self.inner.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        self.inner.finish(status)
