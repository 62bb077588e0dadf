"""The graph ledger's loop hook: each step stamped on the ledger, its events written, explained and checked.

:class:`GraphWatch` writes every rank's ledger events to ``<run dir>/graphs/rank<k>.jsonl`` and, on rank 0, to the
metric series (``graphs/*``); rank 0 logs each compile after the warm-up as expected by the schedule
(``hlat.plan.graph_schedule``) or not; with more than one rank it runs the divergence guard
(``hlat.health.graph_guard``) and hands its stop to the stop hook, so that every rank stops at the same step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlat.backends.graphs import GraphEvent, GraphLedger
from hlat.config import RunConfig
from hlat.health.graph_guard import (
    STOP_GRACE_S,
    GraphDivergenceError,
    GraphGuard,
    LedgerFile,
    refuse_restart,
)
from hlat.health.heartbeat import Heartbeat
from hlat.plan.graph_schedule import WARMUP_STEPS, expected_compiles

log = logging.getLogger(__name__)


def expected_by_step(cfg: RunConfig, start: int) -> dict[int, list[str]]:
    """Step -> the phases the schedule expects to compile there after the warm-up, with why."""
    out: dict[int, list[str]] = {}
    for e in expected_compiles(cfg, start):
        out.setdefault(e.step, []).append(f"{e.phase}: {e.why}")
    return out


class GraphWatch:
    """Loop hook (after the checkpoint hook): the step on the ledger, its events written, checked and logged.

    Build it on every rank; ``start`` it right before the first step and ``close`` it however training ends. The
    guard runs with ``health.graph_guard`` not ``off`` on more than one rank, over ``heartbeat``'s board.
    """

    def __init__(
        self,
        cfg: RunConfig,
        ledger: GraphLedger,
        rank: int,
        run_dir: Path,
        log_metrics: Callable[[list[tuple[int, dict[str, float]]]], None],
        heartbeat: Heartbeat | None = None,
        attempt: int = 0,
    ) -> None:
        refuse_restart(run_dir, attempt)
        self.cfg, self.ledger, self.rank, self.log_metrics = cfg, ledger, rank, log_metrics
        self.file = LedgerFile(run_dir, rank)
        self.expected: dict[int, list[str]] = {}
        self.start_step = 0
        self.guard: GraphGuard | None = None
        if heartbeat is not None and heartbeat.board is not None and cfg.health.graph_guard != "off":
            self.guard = GraphGuard(cfg.health.graph_guard, ledger, heartbeat, run_dir)
        self._thread: threading.Thread | None = None
        self._late = False  # this rank compiled after the warm-up in the last step

    def start(self, step: int) -> None:
        """Training resumes after ``step``: what compiled so far is set-up; the schedule's expectations from here."""
        self.start_step = step
        self.expected = expected_by_step(self.cfg, step)
        self._flush(self.ledger.drain())  # set-up, restore, the pre-flight check: step 0
        self.ledger.at_step(step + 1)
        if self.guard is not None:
            self.guard.start_step = step
            if self.rank == 0:
                self._thread = threading.Thread(target=self.guard.run, name="hlat-graph-guard", daemon=True)
                self._thread.start()

    def __call__(self, state: Any, out: Any = None) -> None:
        step = state.step
        self.ledger.at_step(step + 1)  # what the hooks compiled outside a phase still counts in step ``step``
        events = self.ledger.drain()
        self._flush(events)
        self._explain(step, [e for e in events if e.new_graphs and step > self.start_step + WARMUP_STEPS])
        guard = self.guard
        if guard is None:
            return
        guard.stepped(step)
        guard.heartbeat.publish()  # this step's end on the board before the stop hook's all-reduce (a barrier)
        late = any(e.new_graphs and e.step > self.start_step + WARMUP_STEPS for e in events)
        # After that barrier every rank's beat covers the step before: a rank that compiled late in it (or in this
        # step) reads the board now, rank 0 every log interval; then the stop hook makes the ranks stop together.
        if guard.stopped is None and (late or self._late or (self.rank == 0 and step % self.cfg.train.log_every == 0)):
            guard.check()
        self._late = late
        if guard.stopped is not None and guard.mode == "stop" and step >= self.cfg.train.steps:
            raise GraphDivergenceError(guard.stopped)  # the last step: no agreement follows, nothing to wait for

    def stop_request(self, agreed: bool) -> BaseException | None:
        """For ``hlat.launch.preempt.StopHook.stops``: this rank's divergence, or (``agreed``) another rank's."""
        guard = self.guard
        if guard is None or guard.mode != "stop":
            return None
        if guard.stopped is None and agreed:  # another rank saw it: its message is on the board (or will be)
            for _ in range(int(STOP_GRACE_S / 0.5)):
                if guard.check() is not None or guard._closed.wait(0.5):
                    break
        if guard.stopped is None:
            return (
                GraphDivergenceError("graph divergence seen by another rank (its log says which)") if agreed else None
            )
        guard.close()
        return GraphDivergenceError(guard.stopped)

    def _flush(self, events: list[GraphEvent]) -> None:
        """Write this rank's events; rank 0 also sends each step's totals to the tracker (the Parquet series)."""
        self.file.write(events)
        if self.rank != 0 or not events:
            return
        rows: dict[int, dict[str, float]] = {}
        for e in events:
            row = rows.setdefault(e.step, {"graphs/new": 0.0, "graphs/compile_s": 0.0})
            row["graphs/new"] += e.new_graphs
            row["graphs/compile_s"] += e.compile_s
        for row in rows.values():
            row["graphs/total"] = float(self.ledger.total)
        compiled = [(s, r) for s, r in sorted(rows.items()) if r["graphs/new"]]
        if compiled:
            self.log_metrics(compiled)

    def _explain(self, step: int, late: list[GraphEvent]) -> None:
        """Rank 0 logs each compile after the warm-up: expected by the schedule (info) or not (warning)."""
        if self.rank != 0:
            return
        for e in late:
            planned = [why for why in self.expected.get(step, []) if why.startswith(f"{e.phase}:")]
            what = f"step {step} (phase {e.phase}) compiled {e.new_graphs} new graph(s) in {e.compile_s:.1f}s"
            if planned:
                log.info("graph ledger: %s: expected (planned: %s)", what, planned[0].split(": ", 1)[1])
            else:
                log.warning(
                    "graph ledger: %s: unexpected, the schedule does not predict it (hlat graphs plan says what does; "
                    "each rank's ledger is in %s)",
                    what,
                    self.file.path.parent,
                )

    def close(self) -> None:
        """Write what is left (the last save, a failure's phases) and stop the guard's thread (idempotent)."""
        self.ledger.at_step(self.ledger.step)
        self._flush(self.ledger.drain())
        if self.guard is not None:
            self.guard.close()
