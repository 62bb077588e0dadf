"""What an MLflow run still has to receive, and the thread that sends it: the caller never waits on the network.

Points queue in memory in the order they were logged, each with a sequence number; a sender thread sends them in
batches, then the run's tags, artifacts and final status. A checkpoint calls :meth:`Outbox.persist`: what is not in
MLflow yet goes to the run's spool file (:mod:`hlat.track.spool`), fsync'd, so that every point up to the checkpoint is
either in MLflow or on disk. A server that does not answer is asked again every few seconds, never waited for.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from itertools import islice
from pathlib import Path
from typing import Any

from hlat.track.spool import Point, Spool, artifact_entry, not_yet_stored, step_range

log = logging.getLogger(__name__)

MAX_METRICS, MAX_TAGS = 1000, 100
"""MLflow's REST limits per ``log_batch`` request."""
MAX_QUEUED = 2_000_000
"""Points held in memory at most (~200 MB): past it, during a long outage, new points are counted as dropped."""
SEND_TIMEOUT_S = 5
"""One request to a tracking server, without MLflow's own retries (which wait out minutes): a dead server is a quick
failure, asked again :data:`RETRY_S` later."""
RETRY_S = 2.0


class Transport:
    """Sends to one MLflow store: a tracking server by single short requests, any other store through its client."""

    def __init__(self, client: Any, uri: str) -> None:
        self.client = client
        store = getattr(getattr(client, "_tracking_client", None), "store", None)
        self._creds = getattr(store, "get_host_creds", None) if uri.startswith(("http://", "https://")) else None

    def log_batch(self, run_id: str, points: list[Point], tags: dict[str, str]) -> None:
        """One request with ``points`` and ``tags``."""
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(k, v, ts, step) for k, v, ts, step in points]
        run_tags = [RunTag(k, v) for k, v in tags.items()]
        if self._creds is None:
            self.client.log_batch(run_id, metrics=metrics, tags=run_tags)
            return
        from mlflow.protos.service_pb2 import LogBatch

        body = LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics], tags=[t.to_proto() for t in run_tags])
        self._post("/api/2.0/mlflow/runs/log-batch", body)

    def terminate(self, run_id: str, status: str, end_time: int) -> None:
        """Set the run's final status."""
        if self._creds is None:
            self.client.set_terminated(run_id, status, end_time)
            return
        from mlflow.entities import RunStatus
        from mlflow.protos.service_pb2 import UpdateRun

        body = UpdateRun(run_id=run_id, run_uuid=run_id, status=RunStatus.from_string(status), end_time=end_time)
        self._post("/api/2.0/mlflow/runs/update", body)

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, path, artifact_path)

    def _post(self, endpoint: str, message: Any) -> None:
        from mlflow.utils.proto_json_utils import message_to_json
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        assert self._creds is not None
        body = json.loads(message_to_json(message))
        response = http_request(
            self._creds(), endpoint, "POST", max_retries=0, backoff_factor=0, timeout=SEND_TIMEOUT_S, json=body
        )
        verify_rest_response(response, endpoint)


class Outbox:
    """The points, tags, artifacts and status one MLflow run has still to receive, and their sender thread.

    ``loss_first``: until the first ``train/loss`` is sent the other points wait for it (MLflow's compare view then
    charts the loss by default), unless they fill a batch or the run ends. ``on_first_send`` runs after the first
    successful batch (the system metrics monitor starts then).
    """

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        flush_every_s: float,
        spool: Spool | None,
        *,
        loss_first: bool,
        on_first_send: Any = None,
    ) -> None:
        self.transport, self.run_id, self.flush_every_s, self.spool = transport, run_id, flush_every_s, spool
        self._loss_first, self._on_first_send = loss_first, on_first_send
        self._queue: deque[tuple[int, Point]] = deque()
        self._next_seq = self._spooled = 0
        """Points numbered below ``_spooled`` are in the spool file."""
        self.tags: dict[str, str] = {}
        self.artifacts: list[str | list[str]] = []
        self.status: tuple[str, int] | None = None
        self.dropped = 0
        self.skip: dict[str, int] = {}
        """Per key, the last step MLflow or the spool already holds: a resumed run's replayed steps are not sent."""
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._stopping = self._given_up = self._failing = False
        self._sends = 0
        if spool is not None:
            self._queue.extend(spool.loaded.points)
            self._next_seq = self._spooled = spool.loaded.next_seq
            self.artifacts = list(spool.loaded.meta.get("artifacts", []))
        self._thread = threading.Thread(target=self._run, name="hlat-mlflow-send", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def resume(self, stored: dict[str, int]) -> int:
        """A continued run, given the latest step MLflow holds per key (``stored``); returns the points still waiting.

        The spool's points MLflow already has are dropped; later, so are the replayed steps MLflow or the spool holds.
        """
        self._queue = deque(not_yet_stored(list(self._queue), stored))
        self.skip = dict(stored)
        for _, (key, _, _, step) in self._queue:
            self.skip[key] = max(self.skip.get(key, -1), step)
        return len(self._queue)

    def put(self, rows: list[tuple[int, dict[str, float]]], now_ms: int) -> None:
        """Queue metric rows (the caller's thread: memory only); a replayed step already stored is left out."""
        with self._lock:
            for step, row in rows:
                for key, value in row.items():
                    if 0 < step <= self.skip.get(key, -1):  # step 0: each start's pre-flight record, kept
                        continue
                    if len(self._queue) >= MAX_QUEUED:
                        self.dropped += 1
                        continue
                    self._queue.append((self._next_seq, (key, float(value), now_ms, step)))
                    self._next_seq += 1
            full = len(self._queue) >= MAX_METRICS
        if full or self.flush_every_s == 0:
            self._wake.set()

    def put_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self.tags.update(tags)
        self._wake.set()

    def put_artifact(self, path: str, artifact_path: str | None = None) -> None:
        """Queue file ``path`` for the run's artifacts (under ``artifact_path``: a folder of them, or the top)."""
        with self._lock:
            self.artifacts.append(path if artifact_path is None else [path, artifact_path])
        self._wake.set()

    def persist(self) -> None:
        """Append what MLflow does not hold yet to the spool and fsync it: local disk only, never the network."""
        assert self.spool is not None
        with self._lock:
            fresh = self._fresh()
            if fresh and self.spool.append(self._next_seq - len(fresh), fresh):
                self._spooled = self._next_seq
            self.spool.set_meta(self._meta())
            self.spool.sync()

    def _fresh(self) -> list[Point]:
        """The queued points not in the spool yet: the newest ones (numbers run on, oldest first; under the lock)."""
        n = min(len(self._queue), self._next_seq - self._spooled)
        return [self._queue[-i][1] for i in range(n, 0, -1)]

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"tags": dict(self.tags), "artifacts": list(self.artifacts)}
        if self.status is not None:
            meta["status"], meta["end_time"] = self.status
        return meta

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_every_s or None)
            self._wake.clear()
            stopping = self._stopping
            ok = self.send(everything=stopping)
            if stopping:
                return  # everything sent, or the first failure: finish keeps the rest in the spool
            if not ok:
                self._stop.wait(RETRY_S)  # a dead server is asked again at most every RETRY_S

    def send(self, *, everything: bool, points_only: bool = False) -> bool:
        """Send the queued points, then the artifacts and (``everything``) the status; False at the first failure.

        ``everything``: the points do not wait for the first loss. ``points_only``: not the artifacts and status.
        """
        try:
            while self._send_batch(everything):
                pass
            if not points_only:
                self._send_rest(final=everything)
        except Exception as e:
            if not self._failing:
                log.warning("MLflow did not take the run's metrics (%s); they wait and are sent when it answers", e)
            self._failing = True
            return False
        if self._failing:
            log.info("MLflow answers again; the waiting metrics are sent")
        self._failing = False
        return True

    def _send_batch(self, everything: bool) -> bool:
        """Send the oldest batch of points and up to 100 tags; False when there was nothing to send."""
        with self._lock:
            waiting = self._loss_first and not everything and len(self._queue) < MAX_METRICS
            if waiting and all(p[0] != "train/loss" for _, p in self._queue):
                return False
            batch = list(islice(self._queue, MAX_METRICS))
            tags = dict(islice(self.tags.items(), MAX_TAGS))
        if not batch and not tags:
            return False
        points = [p for _, p in batch]
        if self._loss_first:
            points.sort(key=lambda p: p[0] != "train/loss")  # stable: the losses first, the rest in order
        self.transport.log_batch(self.run_id, points, tags)
        with self._lock:
            if self._given_up:
                return False
            for _ in batch:
                self._queue.popleft()
            for key, value in tags.items():
                if self.tags.get(key) == value:
                    del self.tags[key]
            self._sends += 1
            if self.spool is not None and batch and batch[0][0] < self._spooled:
                self.spool.mark_sent(batch[-1][0] + 1)
                if not self._queue or self._queue[0][0] >= self._spooled:
                    self.spool.compact(self._meta(), self._spooled)
        if self._loss_first and batch:
            self._loss_first = False
            if self._on_first_send is not None:
                self._on_first_send()
        return True

    def _send_rest(self, *, final: bool) -> None:
        """The artifacts, then (``final``) the status: only once every point is in MLflow."""
        while self.artifacts:
            path, where = artifact_entry(self.artifacts[0])
            if Path(path).exists():
                self.transport.log_artifact(self.run_id, path, where)
            else:  # replaced since (the series' parts merge into one file, queued after them): nothing to send
                log.info("artifact %s is gone; not sent", path)
            with self._lock:
                self.artifacts.pop(0)
                self._sends += 1
        if final and self.status is not None:
            self.transport.terminate(self.run_id, *self.status)
            with self._lock:
                self.status = None

    def close(self, status: str) -> dict[str, Any] | None:
        """Send what is left while the store answers; what it did not take stays in the spool.

        Waits as long as sends succeed (a healthy server's cost); stops at the first failure, or when one request
        has made no progress for :data:`SEND_TIMEOUT_S`. Returns None when everything was sent, else what was not:
        ``points``, ``steps`` (first, last), ``tags``, ``artifacts``, ``status``, ``dropped``.
        """
        with self._lock:
            self.status = (status, int(time.time() * 1000))
            self._stopping = True
        self._wake.set()
        self._stop.set()
        if not self._thread.is_alive():  # the sender thread is gone (an error outside a send): one try from here
            self.send(everything=True)
        seen = -1
        while self._thread.is_alive() and self._sends != seen:
            seen = self._sends
            self._thread.join(SEND_TIMEOUT_S + 1)
        with self._lock:
            self._given_up = True
            left = [p for _, p in self._queue]
            if not left and not self.tags and not self.artifacts and self.status is None and not self.dropped:
                if self.spool is not None:
                    self.spool.close(remove=True)
                return None
            if self.spool is not None:
                fresh = self._fresh()
                if not self.spool.append(self._next_seq - len(fresh), fresh):
                    self.dropped += len(fresh)
                self.spool.set_meta(self._meta())
                self.spool.close()
        return {
            "points": len(left),
            "steps": step_range(left),
            "tags": len(self.tags),
            "artifacts": len(self.artifacts),
            "status": self.status[0] if self.status else None,
            "dropped": self.dropped,
        }
