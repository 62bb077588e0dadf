"""The graph ledger in the run directory, and the divergence guard: a rank that compiles a graph the others did not.

On Trainium every rank must run the same graphs: one that traces a new graph alone (a data-dependent shape, a branch
on its rank, a Python scalar that became 0 or 1 only there) compiles for minutes while the others wait in a
collective, then fails with "MPMD detected" or hangs until the runtime's timeout. :class:`GraphWatch` (a loop hook)
stamps each step on the backend's ledger (``hlat.backends.graphs``), writes every event to
``<run dir>/graphs/rank<k>.jsonl`` and, on rank 0, to the metric series (``graphs/*``), logs each compile after the
warm-up as expected (``hlat.plan.graph_schedule``) or not, and publishes the ledger on the heartbeat board.
:func:`find_divergence` compares ranks of one class (ranks whose warm-up compiled alike: pipeline stages differ)
at every (step, phase) all of them have passed; ``health.graph_guard=stop`` then ends the job with
:data:`GRAPH_DIVERGENCE_EXIT_CODE`, naming the rank, step and phase, and a restart of the job refuses to run again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlat.backends.graphs import GraphEvent, GraphLedger
from hlat.config import RunConfig
from hlat.health.heartbeat import Heartbeat
from hlat.plan.graph_schedule import WARMUP_STEPS, expected_compiles

log = logging.getLogger(__name__)

GRAPH_DIVERGENCE_EXIT_CODE = 76
"""Exit code of a job the guard stopped (EX_PROTOCOL: the ranks broke the protocol of running the same graphs)."""
LEDGER_DIR = "graphs"
"""Under the run directory: ``rank<k>.jsonl`` (each rank's ledger) and ``divergence.json``."""
DIVERGENCE_FILE = "divergence.json"
FLAG = "graph-divergence"
"""The board's flag: the divergence's message, for every rank to stop on."""
MAX_EVENTS = 256
"""Post-warm-up events a rank publishes (they are rare: a few per run); past that its ledger is not compared."""
CHECK_EVERY_S = 10.0
"""Rank 0's background check of the board, for ranks blocked in a collective (its loop hook checks every interval)."""
STOP_GRACE_S = 30.0
"""After a divergence, how long the training thread has to stop by itself before the process exits."""


class GraphDivergenceError(RuntimeError):
    """Ranks compiled different graphs at the same step: a restart would only do it again."""

    exit_code = GRAPH_DIVERGENCE_EXIT_CODE


@dataclass(frozen=True)
class Divergence:
    """Ranks of one class that disagree on the new graphs of one (step, phase)."""

    step: int
    phase: str
    compiled: dict[int, tuple[int, str]]
    """Rank -> (new graphs, last fingerprint or "") of the ranks that compiled more there."""
    others: list[int]
    """The ranks of the class that compiled fewer (usually none)."""

    def message(self) -> str:
        ranks = sorted(self.compiled)
        n, fp = self.compiled[ranks[0]]
        what = f"{n} new graph{'s' if n != 1 else ''}" + (f" [{fp}]" if fp else "")
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        return (
            f"graph divergence: {who}, step {self.step} (phase {self.phase}) compiled {what}; "
            f"ranks {_ranks(self.others)} did not"
        )


def _ranks(ranks: list[int]) -> str:
    """``0,1,4-7``: runs of three or more consecutive ranks joined; at most 16 parts named."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i : j + 1]]
        i = j + 1
    shown = ",".join(parts[:16])
    return shown + (f",... ({len(ranks)} ranks)" if len(parts) > 16 else "") if parts else "none"


def find_divergence(snapshots: Mapping[int, Mapping[str, Any] | None]) -> Divergence | None:
    """The earliest (step, phase) at which ranks of one class compiled different numbers of new graphs.

    ``snapshots``: rank -> :meth:`GraphGuard.snapshot` (``cls``: the warm-up class, "" until known; ``pos``: the
    (step, seq) of the phase the rank is in; ``ev``: its post-warm-up events ``[step, seq, phase, n, fp]``;
    ``full``: its events overflowed). Only what every rank of the class has passed is compared.
    """
    classes: dict[str, list[int]] = {}
    for rank, snap in snapshots.items():
        if snap and snap.get("cls") and not snap.get("full"):
            classes.setdefault(snap["cls"], []).append(rank)
    found: list[tuple[tuple[int, int], Divergence]] = []
    for ranks in classes.values():
        if len(ranks) < 2:
            continue
        passed = min(tuple(snapshots[r]["pos"]) for r in ranks)  # type: ignore[index]
        counts: dict[tuple[int, int, str], dict[int, tuple[int, str]]] = {}
        for r in ranks:
            for step, seq, phase, n, fp in snapshots[r]["ev"]:  # type: ignore[index]
                if (step, seq) < passed:
                    counts.setdefault((step, seq, phase), {})[r] = (n, fp)
        for (step, seq, phase), got in sorted(counts.items()):
            most = max(n for n, _ in got.values())
            if len(got) < len(ranks) or min(n for n, _ in got.values()) != most:
                compiled = {r: v for r, v in got.items() if v[0] == most}
                others = sorted(set(ranks) - set(compiled))
                found.append(((step, seq), Divergence(step, phase, compiled, others)))
                break
    return min(found, key=lambda f: f[0])[1] if found else None


class LedgerFile:
    """``<run dir>/graphs/rank<k>.jsonl``: one JSON line per ledger event, appended and flushed as they come."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / LEDGER_DIR / f"rank{rank}.jsonl"

    def write(self, events: list[GraphEvent]) -> None:
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(e.to_json()) + "\n" for e in events)


def read_ledger(path: Path) -> list[GraphEvent]:
    """The events of a ledger file (a line cut short by a kill is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            out.append(GraphEvent.from_json(json.loads(line)))
    return out


class GraphGuard:
    """This rank's side of the guard: its published ledger state, the checks, and the stop.

    ``heartbeat`` carries :meth:`snapshot` on the board with every beat; ``mode`` is ``health.graph_guard``.
    """

    def __init__(
        self,
        mode: str,
        ledger: GraphLedger,
        heartbeat: Heartbeat,
        run_dir: Path,
        *,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.mode, self.ledger, self.heartbeat, self.run_dir = mode, ledger, heartbeat, Path(run_dir)
        self.rank, self.exit_fn = heartbeat.rank, exit_fn
        self.start_step = 0
        self.cls = ""
        self._warm: list[tuple[Any, ...]] = []
        self._events: list[list[Any]] = []
        self.stopped: str | None = None
        """The divergence that stops this rank, once one is found or flagged."""
        self._reported: set[str] = set()
        self._closed = threading.Event()
        heartbeat.graphs = self.snapshot
        ledger.listener = self.on_event

    def on_event(self, e: GraphEvent) -> None:
        """The ledger recorded ``e`` (training thread): warm-up events shape the class, later ones are published."""
        if e.new_graphs == 0:
            return
        fp = e.graphs[-1] if e.graphs else ""
        if e.step <= self.start_step + WARMUP_STEPS:
            self._warm.append((e.step - self.start_step, e.seq, e.phase, e.new_graphs, fp))
        elif len(self._events) < MAX_EVENTS:
            self._events = [*self._events, [e.step, e.seq, e.phase, e.new_graphs, fp]]  # replaced whole: read by beats

    def stepped(self, step: int) -> None:
        """Step ``step`` ended: the warm-up's class is known once it is over."""
        if not self.cls and step >= self.start_step + WARMUP_STEPS:
            self.cls = hashlib.sha1(json.dumps(self._warm).encode()).hexdigest()[:12]

    def snapshot(self) -> dict[str, Any]:
        """What this rank publishes (heartbeat thread): class, position, post-warm-up events."""
        pos = list(self.ledger.position)  # before the events: an event before ``pos`` is already in the list
        return {"cls": self.cls, "pos": pos, "ev": self._events, "full": len(self._events) >= MAX_EVENTS}

    def check(self, *, in_thread: bool = False) -> str | None:
        """Read the board; on a divergence, record and flag it (and stop, in mode ``stop``). Returns its message."""
        board = self.heartbeat.board
        if board is None or self.mode == "off":
            return None
        flagged = board.flag(FLAG)
        if flagged is not None:
            self.stopped = json.loads(flagged)["message"]
            return self.stopped
        beats, unread = self.heartbeat.read()
        if unread is not None:
            return None
        found = find_divergence({r: (b.graphs if b is not None else None) for r, b in beats.items()})
        if found is None:
            return None
        return self._diverged(found, in_thread)

    def _diverged(self, d: Divergence, in_thread: bool) -> str:
        message = d.message()
        if message in self._reported:
            return message
        self._reported.add(message)
        where = self.run_dir / LEDGER_DIR
        record = {
            "message": message,
            "attempt": self.heartbeat.attempt,
            "rank": self.rank,
            "step": d.step,
            "phase": d.phase,
            "compiled": sorted(d.compiled),
            "others": d.others,
        }
        log.error("%s (seen by rank %d; each rank's graph ledger: %s/rank<k>.jsonl)", message, self.rank, where)
        if self.mode == "warn":
            return message
        with contextlib.suppress(OSError):
            where.mkdir(parents=True, exist_ok=True)
            if not (where / DIVERGENCE_FILE).exists():
                (where / DIVERGENCE_FILE).write_text(json.dumps(record) + "\n")
        board = self.heartbeat.board
        if board is not None:
            with contextlib.suppress(Exception):  # a board that went away: this rank stops anyway
                board.raise_flag(FLAG, json.dumps(record))
        self.stopped = message
        if in_thread:  # the training thread may be blocked in a collective: exit if it does not stop by itself
            threading.Thread(target=self._exit_later, name="hlat-graph-guard-exit", daemon=True).start()
        return message

    def wait_for_flag(self, timeout_s: float, every_s: float = 0.5) -> None:
        """Read the board until a divergence is known (:attr:`stopped`) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.stopped is None and self.check() is None and time.monotonic() < deadline:
            if self._closed.wait(every_s):
                return

    def _exit_later(self) -> None:
        if not self._closed.wait(STOP_GRACE_S):
            log.error("graph divergence: the training thread did not stop; exiting %d", GRAPH_DIVERGENCE_EXIT_CODE)
            for h in logging.getLogger().handlers:
                h.flush()
            self.exit_fn(GRAPH_DIVERGENCE_EXIT_CODE)

    def run(self) -> None:
        """Rank 0's background check (until :meth:`close`)."""
        while not self._closed.wait(CHECK_EVERY_S):
            with contextlib.suppress(Exception):  # the board may hiccup: the next round reads it again
                if self.check(in_thread=True) is not None and self.mode == "stop":
                    return

    def close(self) -> None:
        self._closed.set()


def refuse_restart(run_dir: Path, attempt: int) -> None:
    """Raise if an earlier attempt of this job stopped on a graph divergence (a restart would diverge again).

    A new launch of the run directory (attempt 0) starts over: the old record is renamed aside.

    Raises:
        GraphDivergenceError: naming the divergence and the record.
    """
    path = Path(run_dir) / LEDGER_DIR / DIVERGENCE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if attempt > int(record.get("attempt", 0)):
        raise GraphDivergenceError(
            f"{record.get('message', 'graph divergence')} (attempt {record.get('attempt', 0)} of this job; {path}): "
            "restarting would compile the same graphs again, so the job stops; fix the cause (the graph ledgers "
            f"beside it say which graphs each rank compiled) and launch it again"
        )
    if attempt == 0:
        with contextlib.suppress(OSError):
            path.rename(path.with_name(f"{DIVERGENCE_FILE}.previous"))


def divergence_text(run_dir: Path) -> str | None:
    """The message of the divergence recorded in ``run_dir`` (for the exit code's explanation), or None."""
    try:
        return str(json.loads((Path(run_dir) / LEDGER_DIR / DIVERGENCE_FILE).read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
