"""Heartbeats: each rank's step, phase and time where the other ranks can read them, so a hang names who stopped.

A stopped rank cannot say so, and the ranks waiting for it look hung too. So the training thread records its step
and phase (no lock, no I/O), a daemon thread publishes them on a *board* (torch elastic's agent store, else files),
and a stopped process's beat ages. Beat times are wall-clock: NTP skew (ms) is far below the staleness bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

EVERY_S = 1.0
"""Seconds between two beats of a rank in a job of up to :data:`MAX_BEATS_PER_S` ranks."""
MAX_BEATS_PER_S = 1000
"""Beats per second the board takes at most from the whole job: larger jobs beat less often."""
READ_TIMEOUT_S = 10.0
"""Seconds a firing watchdog waits for the board to answer before it reports without the other ranks."""
STORE_TIMEOUT_S = 30.0
"""Time-out of the heartbeat's store client (connecting, and an operation on a server that is up)."""
STORE_PREFIX = "hlat/heartbeat"
START, STEP_END = "start", "step end"
"""The phases the heartbeat sets itself: before the first step, and from the end of a step until the next phase."""


@dataclass(frozen=True)
class Beat:
    """What one rank was doing at ``time``."""

    rank: int
    host: str
    pid: int
    local_rank: int
    attempt: int
    """The job's attempt (:mod:`hlat.launch.attempt`): a beat left by an earlier attempt is not this one's."""
    step: int
    """The last step this rank completed (the watchdog's loop hook saw it)."""
    phase: str
    """The phase it entered last: ``start``, ``step end`` (hooks after the step, the next batch) or a timer phase."""
    seq: int
    """Phases entered since ``step``: with ``step``, how far a rank got (every rank enters the same phases)."""
    phase_since: float
    """Wall time it entered ``phase``."""
    time: float
    """Wall time of this beat."""
    graphs: dict[str, Any] | None = None
    """The graph ledger's state (``hlat.health.graph_guard.GraphGuard.snapshot``) where the guard runs."""

    @property
    def position(self) -> tuple[int, int]:
        """How far this rank got; larger is further."""
        return self.step, self.seq

    def where(self) -> str:
        """Where the rank is, in words: ``in step 7 (backward)``, ``after step 6``, ``starting at step 5``."""
        if self.phase == START:
            return f"starting at step {self.step + 1}"
        if self.phase == STEP_END:
            return f"after step {self.step}"
        return f"in step {self.step + 1} ({self.phase})"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Beat:
        return cls(**json.loads(text))


class Board(Protocol):
    """Where beats are published and read, and where a rank raises a flag every rank can see."""

    def publish(self, beat: Beat) -> None: ...

    def read(self) -> dict[int, Beat | None]: ...

    def describe(self) -> str: ...

    def raise_flag(self, name: str, text: str) -> None: ...

    def flag(self, name: str) -> str | None: ...


def beat_period(world_size: int) -> float:
    """Seconds between two beats of one rank: :data:`EVERY_S`, longer for jobs beyond :data:`MAX_BEATS_PER_S` ranks."""
    return max(EVERY_S, world_size / MAX_BEATS_PER_S)


class Heartbeat:
    """This rank's beat: recorded by the training thread, published by a daemon thread, read when a hang fires.

    ``board`` None: nowhere to publish (one process); a beat of another ``attempt`` reads as missing.
    """

    def __init__(
        self,
        rank: int,
        board: Board | None = None,
        *,
        attempt: int = 0,
        every_s: float = EVERY_S,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rank, self.board, self.attempt, self.every_s, self.wall = rank, board, attempt, every_s, wall
        self.graphs: Callable[[], dict[str, Any]] | None = None
        """What the graph guard publishes with each beat (set by the guard; None without one)."""
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # (step, phase, seq, since): replaced whole by the training thread, read whole by the others.
        self._now: tuple[int, str, int, float] = (0, START, 0, wall())
        self._stop = threading.Event()
        self._io = threading.Lock()  # one board operation at a time (the publisher's and a reader's)
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self, step: int) -> None:
        """Training resumes after ``step``; start publishing (with a board)."""
        self._now = (step, START, 0, self.wall())
        if self.board is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hlat-heartbeat", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop publishing (idempotent). The thread is not joined: it may be blocked on a board that hangs."""
        self._stop.set()

    def mark(self, phase: str) -> None:
        """The training thread enters ``phase`` (called by :class:`PhaseMarks`)."""
        step, _, seq, _ = self._now
        self._now = (step, phase, seq + 1, self.wall())

    def stepped(self, step: int) -> None:
        """Step ``step`` is complete (the watchdog's loop hook)."""
        self._now = (step, STEP_END, 0, self.wall())

    def beat(self) -> Beat:
        """This rank's beat as of now."""
        step, phase, seq, since = self._now
        graphs = self.graphs() if self.graphs is not None else None
        return Beat(
            self.rank, self.host, self.pid, self.local_rank, self.attempt, step, phase, seq, since, self.wall(), graphs
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish()
            self._stop.wait(self.every_s)

    def publish(self) -> None:
        """Publish this rank's beat now; a failure is logged once and retried at the next beat."""
        if self.board is None:
            return
        try:
            with self._io:
                self.board.publish(self.beat())
        except Exception as e:  # a store that went away, a full disk: the training goes on without beats
            if not self._failed:
                log.warning(
                    "heartbeat: could not publish rank %d's beat to %s: %s", self.rank, self.board.describe(), e
                )
            self._failed = True

    def read(self, timeout_s: float = READ_TIMEOUT_S) -> tuple[dict[int, Beat | None], str | None]:
        """Every rank's beat of this attempt (None: none found; this rank's as of now), and why the board failed."""
        # In a thread waited for at most timeout_s: a store op on a server that stopped blocks for good (torch 2.13
        # does not honour the client time-out there), so the watchdog's own thread never touches the board.
        own = self.beat()
        if self.board is None:
            return {self.rank: own}, None
        result: list[Any] = []
        board = self.board

        def read() -> None:
            try:
                with self._io:
                    result.append(board.read())
            except Exception as e:
                result.append(e)

        reader = threading.Thread(target=read, name="hlat-heartbeat-read", daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result:
            return {self.rank: own}, f"{board.describe()} did not answer within {timeout_s:g}s"
        if isinstance(result[0], Exception):
            return {self.rank: own}, f"{board.describe()} failed: {result[0]}"
        beats = {r: b if b is not None and b.attempt == self.attempt else None for r, b in result[0].items()}
        beats[self.rank] = own
        return beats, None


class PhaseMarks:
    """The step's phase timer (``train.step_breakdown``'s, or the null one), marking each phase on the heartbeat."""

    def __init__(self, timer: Any, heartbeat: Heartbeat) -> None:
        self.timer, self.heartbeat = timer, heartbeat

    @property
    def enabled(self) -> bool:
        return self.timer.enabled

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        self.heartbeat.mark(name)
        return self.timer.phase(name)

    def add(self, name: str, seconds: float) -> None:
        self.timer.add(name, seconds)

    def take(self) -> dict[str, float]:
        return self.timer.take()


class StoreBoard:
    """Beats under :data:`STORE_PREFIX` in a ``torch.distributed`` store (torch elastic's, hosted by the agent)."""

    def __init__(self, store: Any, world_size: int, where: str = "the job's store") -> None:
        self.store, self.world_size, self.where = store, world_size, where

    @classmethod
    def connect(cls, world_size: int) -> StoreBoard:
        """A client of the store at ``MASTER_ADDR:MASTER_PORT`` (torch elastic's, for the workers)."""
        import torch.distributed as dist

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )
        return cls(store, world_size, f"torch elastic's store at {host}:{port}")

    def key(self, rank: int) -> str:
        return f"{STORE_PREFIX}/{rank}"

    def publish(self, beat: Beat) -> None:
        self.store.set(self.key(beat.rank), beat.to_json())

    def read(self) -> dict[int, Beat | None]:
        keys = [self.key(r) for r in range(self.world_size)]
        if self.store.check(keys):  # the usual case: every rank has beaten; one round trip for all
            values: list[bytes | None] = list(self.store.multi_get(keys))
        else:  # a get of a missing key would wait for it
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return {r: None if v is None else Beat.from_json(v) for r, v in enumerate(values)}

    def describe(self) -> str:
        return self.where

    def raise_flag(self, name: str, text: str) -> None:
        self.store.set(f"{STORE_PREFIX}/flag/{name}", text)

    def flag(self, name: str) -> str | None:
        key = f"{STORE_PREFIX}/flag/{name}"
        return self.store.get(key).decode() if self.store.check([key]) else None


class FileBoard:
    """Beats as files ``<directory>/rank<N>.json``, each replaced whole (for jobs without torch elastic's store)."""

    def __init__(self, directory: Path, world_size: int) -> None:
        self.directory, self.world_size = Path(directory), world_size

    def publish(self, beat: Beat) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".rank{beat.rank}.json.tmp"
        tmp.write_text(beat.to_json())
        os.replace(tmp, self.directory / f"rank{beat.rank}.json")

    def read(self) -> dict[int, Beat | None]:
        return {r: _read_beat(self.directory / f"rank{r}.json") for r in range(self.world_size)}

    def describe(self) -> str:
        return f"the heartbeat files in {self.directory}"

    def raise_flag(self, name: str, text: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".flag-{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / f"flag-{name}")

    def flag(self, name: str) -> str | None:
        with contextlib.suppress(FileNotFoundError):
            return (self.directory / f"flag-{name}").read_text()
        return None


def _read_beat(path: Path) -> Beat | None:
    with contextlib.suppress(FileNotFoundError):
        return Beat.from_json(path.read_text())
    return None


def board_for(world_size: int, directory: Path) -> Board | None:
    """The job's board: torch elastic's store when the workers share the agent's, else files; None for one process."""
    # The agent's store outlives a stopped worker; under plain env:// rank 0's process hosts the store, hence files.
    from hlat.launch import attempt

    if world_size == 1:
        return None
    if attempt.shared():
        try:
            return StoreBoard.connect(world_size)
        except Exception as e:  # the workers reached it a moment ago: unlikely, and the files still work
            log.warning("heartbeat: torch elastic's store is out of reach (%s); using files in %s", e, directory)
    return FileBoard(directory, world_size)
