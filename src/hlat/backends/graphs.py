"""The graph ledger: which step and phase of a run compiled new XLA graphs, how many, in how long, and which ones.

On Trainium every new graph is a neuronx-cc compile, and a rank that traces a graph the others do not hangs the job
(the runtime only says "MPMD"). The neuron backend wraps each of its syncs in :meth:`GraphLedger.phase`, which reads
torch-xla's compile counters before and after (host lookups: no graph, no transfer), and records an event when the
phase compiled something. The trainer's ledger hook (``hlat.health.graph_guard``) stamps the step, writes each
rank's events to ``<run dir>/graphs/rank<k>.jsonl`` and the Parquet series, and the divergence guard compares ranks.

Fingerprints: with ``health.graph_hlo_dir`` set, torch-xla writes every graph it runs to a file per rank
(:func:`hlo_dump_env`) and each phase's record carries the canonical fingerprints of the graphs it ran
(``hlat.plan.hlo``), compiled or not: what ``hlat graphs plan`` compares between sweep arms. Off by default: it lowers
every sync's graph to HLO text.

Backend-neutral: the torch backend has no ledger; nothing here imports torch-xla.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hlat.plan.hlo import parse_dump

SETUP, RESTORE, FORWARD_BACKWARD, OPTIMIZER, FETCH, CHECKPOINT, SYNC, OTHER = (
    "setup",
    "restore",
    "forward_backward",
    "optimizer",
    "fetch",
    "checkpoint",
    "sync",
    "other",
)
"""The phases a ledger names: NxD's set-up and model build, a checkpoint restore, one micro-batch's forward and
backward, the optimizer step (cut at the step's end), the metrics fetch, a checkpoint save, an explicit device sync
(timers, the pre-flight check), and anything compiled outside them."""
HLO_FILE = "rank{rank}.hlo"
"""Each rank's dump file under ``health.graph_hlo_dir`` (torch-xla appends ``.<device ordinal>``)."""


@dataclass(frozen=True)
class GraphEvent:
    """One phase of one step that compiled new graphs (or, with fingerprints, any phase that ran graphs)."""

    step: int
    """The step in flight (1 = the first optimizer step); 0 for set-up, restore and the pre-flight check."""
    seq: int
    """The phase's position within the step (the n-th phase the ledger saw since the step began): the same on every
    rank that runs the same code, so ranks compare at (step, seq)."""
    phase: str
    """One of the phases above."""
    micro: int | None
    """The micro-batch (from 0) of a forward_backward phase; None otherwise."""
    new_graphs: int
    """Graphs this process had not compiled before (torch-xla's ``UncachedCompile``; on trn1 each one is a neuronx-cc
    compile or a Neuron persistent cache lookup)."""
    compile_s: float
    """Seconds those compiles took (torch-xla's ``CompileTime``)."""
    graphs: tuple[str, ...] = ()
    """Canonical fingerprints of every graph the phase ran, in order (with ``health.graph_hlo_dir``; else empty)."""
    raw: tuple[str, ...] = ()
    """torch-xla's own hash of each of those graphs (comparable within one torch-xla build and device only)."""
    transfers: int = 0
    """Device-to-host transfers in the phase (with fingerprints on; else 0): a sync inside a step shows here."""
    fallbacks: int = 0
    """Ops that ran on the CPU for want of a lowering (with fingerprints on; else 0)."""
    time: float = field(default=0.0, compare=False)
    """Wall time the phase ended."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GraphEvent:
        return cls(**{**d, "graphs": tuple(d.get("graphs", ())), "raw": tuple(d.get("raw", ()))})


def hlo_dump_env(directory: str | Path, rank: int) -> dict[str, str]:
    """torch-xla's variables that write every graph this rank runs, as HLO text, to ``directory/rank<k>.hlo.0``.

    Creates ``directory`` (torch-xla would silently write nothing).
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    return {"XLA_SAVE_TENSORS_FILE": str(Path(directory) / HLO_FILE.format(rank=rank)), "XLA_SAVE_TENSORS_FMT": "hlo"}


class HloTail:
    """Reads what torch-xla appended to one rank's dump file since the last read (:func:`hlat.plan.hlo.parse_dump`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Fingerprints and torch-xla hashes of the graphs written since the last call (none if there is no file)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return (), ()
        graphs, used = parse_dump(text)
        self.offset += len(text[:used].encode("utf-8", errors="replace"))
        return tuple(g.fingerprint for g in graphs), tuple(g.raw_hash for g in graphs)


Counters = Callable[[], tuple[int, float]]
"""Returns this process's (graphs compiled, compile seconds) so far."""
Hygiene = Callable[[], tuple[int, int]]
"""Returns this process's (device-to-host transfers, CPU fallback ops) so far."""


class GraphLedger:
    """Per-phase compile accounting of one rank. The training thread records; :meth:`drain` hands events on.

    ``counters`` reads the compile count and seconds (torch-xla's metrics on the neuron backend); ``hlo`` reads the
    dump file when fingerprints are on. Cheap when nothing compiles: two counter lookups per phase, no I/O.
    """

    def __init__(
        self,
        counters: Counters,
        hlo: HloTail | None = None,
        wall: Callable[[], float] = time.time,
        hygiene: Hygiene | None = None,
    ) -> None:
        self.counters, self.hlo, self.wall, self.hygiene = counters, hlo, wall, hygiene
        self.step = 0
        """The step in flight (:meth:`at_step`)."""
        self.seq = 0
        self.total = 0
        """New graphs since the ledger started."""
        self._last = counters()
        self._moved = hygiene() if hygiene is not None else (0, 0)
        self._events: list[GraphEvent] = []
        self._depth = 0
        self.listener: Callable[[GraphEvent], None] | None = None
        """Called with each event as it is recorded (the divergence guard publishes them at once)."""

    def at_step(self, step: int) -> None:
        """Step ``step`` begins (the trainer's hook, after step ``step - 1`` ended): phases count from 0 again."""
        self._note(OTHER, None)  # whatever the hooks compiled outside a phase belongs to the step that ran them
        self.step, self.seq = step, 0

    @property
    def position(self) -> tuple[int, int]:
        """(step, seq) of the next phase: how far this rank's ledger got."""
        return self.step, self.seq

    @contextlib.contextmanager
    def phase(self, name: str, micro: int | None = None) -> Iterator[None]:
        """Account what runs inside to phase ``name`` (nested phases count in the outermost)."""
        if self._depth:
            yield
            return
        self._note(OTHER, None)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._note(name, micro, always=self.hlo is not None)

    def _note(self, name: str, micro: int | None, *, always: bool = False) -> None:
        """Record what compiled since the last reading as ``name`` (an event if anything did, or ``always``)."""
        count, seconds = self.counters()
        new, spent = count - self._last[0], seconds - self._last[1]
        self._last = (count, seconds)
        graphs, raw = self.hlo.read() if self.hlo is not None else ((), ())
        moved = (0, 0)
        if self.hygiene is not None:
            now = self.hygiene()
            moved, self._moved = (now[0] - self._moved[0], now[1] - self._moved[1]), now
        if new or (always and graphs) or (name == OTHER and (graphs or any(moved))):
            spent = round(spent, 6)
            event = GraphEvent(self.step, self.seq, name, micro, new, spent, graphs, raw, *moved, time=self.wall())
            self._events.append(event)
            self.total += new
            if self.listener is not None:
                self.listener(event)
        if name != OTHER:  # the phases every rank runs set the positions; "other" takes the next phase's
            self.seq += 1

    def drain(self) -> list[GraphEvent]:
        """The events recorded since the last call, oldest first."""
        out, self._events = self._events, []
        return out
