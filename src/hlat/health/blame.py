"""Which rank a hang is about: the verdict a firing watchdog draws from every rank's heartbeat, and its report.

Every waiting rank's watchdog fires, so the heartbeats decide: ranks whose beat went stale (or never came) are the
suspects; else the live ranks furthest behind; else nobody (the stack dumps tell). The report goes to
``<run dir>/hang/report.txt`` and ``report.jsonl`` (which ``python train.py`` reads when restarts run out).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hlat.health.heartbeat import Beat

STALE_BEATS = 5
"""A beat is stale after at least this many missed beat periods."""
STOPPED, SILENT, BEHIND = "stopped", "silent", "behind"


@dataclass(frozen=True)
class Suspect:
    """A rank the hang is about, and why: ``stopped`` (its beat aged), ``silent`` (no beat), ``behind``."""

    rank: int
    why: str
    beat: Beat | None


def stale_after(limit_s: float, every_s: float) -> float:
    """Seconds after which a rank's beat counts as stopped, for a watchdog that fired after ``limit_s``.

    Half the threshold: a stopped rank's beat is about ``limit_s`` old, a live one's a beat period at most.
    """
    return max(STALE_BEATS * every_s, limit_s / 2)


def blame(beats: Mapping[int, Beat | None], now: float, stale_s: float) -> list[Suspect]:
    """The ranks a hang is about (see the module docstring), by rank; empty when every rank is alive and level."""
    gone = [
        Suspect(r, SILENT, None) if b is None else Suspect(r, STOPPED, b)
        for r, b in sorted(beats.items())
        if b is None or now - b.time > stale_s
    ]
    if gone:
        return gone
    alive = {r: b for r, b in beats.items() if b is not None}
    front = max(b.position for b in alive.values())
    return [Suspect(r, BEHIND, b) for r, b in sorted(alive.items()) if b.position < front]


def verdict(
    suspects: list[Suspect], beats: Mapping[int, Beat | None], me: int, now: float, unread: str | None = None
) -> str:
    """One sentence: who the hang is about, where they are, and where this rank (``me``) waits."""
    own = beats[me]
    assert own is not None, "the firing rank's own beat is always known"
    if unread is not None:
        return f"the other ranks' heartbeats could not be read ({unread}); rank {me} is {own.where()}"
    if not suspects:
        return (
            f"no rank stopped: every rank's heartbeat is fresh and at the same point ({own.where()}); a collective "
            "that every rank entered does not complete, or the ranks wait in different ones (compare their stack "
            "dumps)"
        )
    said = "; ".join(_suspect_text(s, me, now) for s in suspects)
    if suspects[0].why == BEHIND:
        front = max((b for b in beats.values() if b is not None), key=lambda b: b.position)
        return f"{said}, while the others are {front.where()}"
    return f"{said}; rank {me} waits {own.where()}"


def _suspect_text(s: Suspect, me: int, now: float) -> str:
    if s.beat is None:
        return f"rank {s.rank} sent no heartbeat in this attempt"
    b = s.beat
    who = f"rank {s.rank}{' (this rank)' if s.rank == me else ''} on {b.host} (pid {b.pid})"
    if s.why == STOPPED:
        return f"{who} stopped: last heartbeat {now - b.time:.1f}s ago, when it was {b.where()}"
    return f"{who} is behind: {b.where()} for {now - b.phase_since:.1f}s"


@dataclass(frozen=True)
class Verdict:
    """What a firing watchdog concluded, and from what."""

    said: str
    """The sentence (:func:`verdict`)."""
    suspects: list[Suspect]
    beats: Mapping[int, Beat | None]
    now: float
    """Wall time of the reading."""


def judge(beats: Mapping[int, Beat | None], me: int, now: float, stale_s: float, unread: str | None = None) -> Verdict:
    """:func:`blame` and :func:`verdict` together; nobody is blamed when the board could not be read (``unread``)."""
    suspects = [] if unread is not None else blame(beats, now, stale_s)
    return Verdict(verdict(suspects, beats, me, now, unread), suspects, beats, now)


def write_report(directory: Path, header: str, v: Verdict, extra: dict) -> Path:
    """Append this firing to ``report.txt`` (readable) and ``report.jsonl`` (one object); returns the text file."""
    directory.mkdir(parents=True, exist_ok=True)
    named = {s.rank: s.why for s in v.suspects}
    rows = [("rank", "host", "pid", "local", "step", "phase", "in phase", "last beat", "verdict")]
    rows += [_row(r, b, v.now, named.get(r, "")) for r, b in sorted(v.beats.items())]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    note = "(step: the last completed step; phase: the last one entered)"
    text = directory / "report.txt"
    with open(text, "a", encoding="utf-8") as f:  # one write per firing: two ranks' reports do not interleave
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n{v.said}\n{note}\n{table}\n\n")
    record = {
        "time": v.now,
        **extra,
        "verdict": v.said,
        "suspects": [{"rank": s.rank, "why": s.why} for s in v.suspects],
    }
    record["beats"] = {str(r): None if b is None else asdict(b) for r, b in sorted(v.beats.items())}
    with open(directory / "report.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return text


def _row(rank: int, b: Beat | None, now: float, why: str) -> tuple[str, ...]:
    if b is None:
        return (str(rank), "?", "?", "?", "?", "?", "?", "none", why)
    cells = (b.host, b.pid, b.local_rank, b.step, b.phase, f"{now - b.phase_since:.1f}s", f"{now - b.time:.1f}s ago")
    return (str(rank), *map(str, cells), why)


def last_verdict(directory: Path) -> str | None:
    """The verdict of the newest report in ``directory`` (``report.jsonl``), or None without one."""
    try:
        lines = (directory / "report.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return str(json.loads(line)["verdict"])
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill: try the one before
            continue
    return None
