"""System metrics (CPU, memory, disk, network, GPU): MLflow's collectors, sampled here, logged through the outbox.

MLflow's own ``SystemMetricsMonitor`` (mlflow.system_metrics) ends its thread for good at the first failed request:
after each sample it asks the server for the run's status (``get_run``) and returns when that or its ``log_batch``
raises, and every such request first waits out MLflow's HTTP retries. One blip of the tracking server and a long run
has no CPU, memory or device series from then on. :class:`SystemSampler` keeps MLflow's collectors and their
aggregation (the same ``system/...`` keys and ``MLFLOW_SYSTEM_METRICS_*`` settings) and hands each mean to the run's
outbox (:mod:`hlat.track.outbox`), which holds points through an outage, spools them at checkpoints and sends them,
with the time they were taken, when the server answers. Nothing here touches the network.

May import: mlflow, only inside functions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PREFIX = "system/"
"""MLflow's prefix of system metrics (its UI shows them in a section of their own)."""

JOIN_S = 5.0
"""At the end, how long the sampling thread is waited for (it reads local counters only; a hung sensor is left)."""

Put = Callable[[list[tuple[int, dict[str, float]]], int], None]
"""Where the means go: ``put(rows, time_ms)`` (``Outbox.put``)."""


class SystemSampler:
    """A thread that samples every ``interval_s`` and puts the mean of every ``samples`` samples, at steps 0, 1, ...

    ``first_step``: the step of the first mean (a continued run numbers on after the points MLflow and its spool
    hold). ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` / ``_SAMPLES_BEFORE_LOGGING`` / ``_NODE_ID`` override the
    interval, the count and add a node to the keys, as they do for MLflow's monitor.
    """

    def __init__(self, put: Put, first_step: int, interval_s: float, samples: int, uri: str) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its collectors, settings and aggregation only: its thread (start) is never run, so it sends nothing. The
        # run's store ``uri`` is named only because it opens a client to it (without one: the default store's).
        self._mlflow = SystemMetricsMonitor(
            "", sampling_interval=interval_s, samples_before_logging=samples, tracking_uri=uri
        )
        self.interval_s = float(self._mlflow.sampling_interval)
        self.samples = max(1, int(self._mlflow.samples_before_logging))
        node = self._mlflow.node_id
        self._prefix = PREFIX + (f"{node}/" if node else "")
        self.step, self._put, self._taken = first_step, put, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hlat-system-metrics", daemon=True)
        self._sample()  # a first reading, not kept: CPU utilization is measured between two readings
        self._clear()

    def start(self) -> None:
        self._thread.start()

    def _sample(self) -> None:
        try:
            self._mlflow.collect_metrics()
            self._taken += 1
        except Exception as e:  # a sensor that fails (a GPU gone) must not end the run's sampling
            log.debug("system metrics sample failed: %s", e)

    def _clear(self) -> None:
        for monitor in self._mlflow.monitors:
            monitor.clear_metrics()
        self._taken = 0

    def _publish(self) -> None:
        """Put the mean of the samples taken since the last one (none: nothing)."""
        if not self._taken:
            return
        means = {self._prefix + k: float(v) for k, v in self._mlflow.aggregate_metrics().items()}
        self._clear()
        if means:
            self._put([(self.step, means)], int(time.time() * 1000))
            self.step += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()
            if self._taken >= self.samples:
                self._publish()

    def finish(self) -> None:
        """Stop, and put the mean of the samples since the last point with one last sample (a short run has one)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_S)
        self._sample()
        self._publish()
