"""The divergence guard: a rank that compiles a graph the others did not, named and stopped.

On Trainium every rank must run the same graphs: one that traces a new graph alone (a data-dependent shape, a branch
on its rank, a Python scalar that became 0 or 1 only there) compiles for minutes while the others wait in a
collective, then fails with "MPMD detected" or hangs until the runtime's timeout. Each rank's ledger
(``hlat.backends.graphs``; written by ``hlat.health.graph_watch``'s loop hook to ``<run dir>/graphs/rank<k>.jsonl``)
is published on the heartbeat board by :class:`GraphGuard`. :func:`find_divergence` compares ranks of one class
(ranks whose warm-up compiled alike: pipeline stages differ) at every (step, phase) all of them have passed;
``health.graph_guard=stop`` then ends the job with :data:`GRAPH_DIVERGENCE_EXIT_CODE`, naming the rank, step and
phase, and a restart of the job refuses to run again.
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
from hlat.health.heartbeat import Heartbeat
from hlat.plan.graph_schedule import WARMUP_STEPS

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
