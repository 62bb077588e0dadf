"""The goodput ledger: where every second of a training job went, per attempt and for the job.

An attempt is one process start of the trainer. Its clock runs from the process start to its latest record and is
split, with nothing left over, into start-up (process start to the end of its first step: imports, building, the
pre-flight check, compile; less the checkpoint load), checkpoint load, checkpoint save (the part that blocks
training), evaluation (waiting for the evaluations along training to end), data wait (the loader) and the time of the
steps it computed. The job adds the gap between attempts (one attempt's latest record to the next one's process
start: the time a dead process ran after its last record, the scheduler's requeue, the restart). A step computed
after the checkpoint that the next attempt resumed from (or a rollback went back to) was thrown away: its time is
replayed work. What is left is productive, and ETTR (effective training time ratio, arXiv 2410.21680) is productive
time over the job's wall time.

Each attempt keeps its record in the job directory (:func:`hlat.checkpoint.job_dir.write_attempt`), rewritten at every
log interval and checkpoint, so the next attempt reads what a SIGKILLed one knew last.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOST = ("startup_s", "load_s", "save_s", "eval_s", "data_wait_s", "replayed_s", "gap_s")
"""The buckets of lost time, in the order tables show them."""


@dataclass
class Attempt:
    """One attempt's record: its clock and what it spent it on (seconds, wall clock)."""

    attempt: int
    """0 for the job's first start, then 1, 2 ..."""
    start: float
    """The process start (``time.time()`` scale)."""
    end: float
    """The latest time accounted for (the record's last write)."""
    resumed_step: int = 0
    """The step this attempt started from (0: a new job)."""
    last_step: int = 0
    """The last step this attempt completed and accounted for."""
    status: str = "running"
    startup_s: float = 0.0
    load_s: float = 0.0
    save_s: float = 0.0
    eval_s: float = 0.0
    data_wait_s: float = 0.0
    steps_s: float = 0.0
    """The time of the steps computed (its first one is start-up), data wait and blocking saves excluded."""
    rolled_back_s: float = 0.0
    """Step time thrown away by rollbacks within this attempt (``train.on_nonfinite=rollback``)."""
    at_step: dict[int, float] = field(default_factory=dict)
    """``steps_s`` as it was at each checkpointed step: what a restart from that checkpoint keeps."""

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Attempt:
        """A record read back from JSON (its ``at_step`` keys are strings there)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        values["at_step"] = {int(k): float(v) for k, v in record.get("at_step", {}).items()}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able state."""
        return dataclasses.asdict(self)

    def kept_s(self, step: int) -> float:
        """Step time of this attempt that a restart from ``step`` keeps (the rest is replayed)."""
        if step >= self.last_step:
            return self.steps_s
        saved = [k for k in self.at_step if k <= step]
        return self.at_step[max(saved)] if saved else 0.0


def replayed_s(attempt: Attempt, next_resumed: int | None) -> float:
    """Step time of ``attempt`` thrown away: its rollbacks, and its steps after ``next_resumed``.

    ``next_resumed``: the step the next attempt resumed from; None while there is no next attempt.
    """
    lost = 0.0 if next_resumed is None else attempt.steps_s - attempt.kept_s(next_resumed)
    return attempt.rolled_back_s + lost


def summarize(attempts: list[Attempt]) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Per-attempt rows and the job's totals: the lost buckets, productive and wall time, ETTR.

    Every row's buckets plus its productive time make its wall time (``end - start``) plus the gap before it; the
    totals' make the job's wall time (the first start to the latest record).
    """
    rows: list[dict[str, float]] = []
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1].resumed_step if i + 1 < len(attempts) else None
        replayed = replayed_s(a, nxt)
        row = {
            "attempt": float(a.attempt),
            "resumed_step": float(a.resumed_step),
            "last_step": float(a.last_step),
            "wall_s": a.end - a.start,
            "gap_s": max(0.0, a.start - attempts[i - 1].end) if i else 0.0,
            **{k: getattr(a, k) for k in ("startup_s", "load_s", "save_s", "eval_s", "data_wait_s")},
            "replayed_s": replayed,
            "productive_s": a.steps_s - replayed,
        }
        rows.append(row)
    total = {k: sum(r[k] for r in rows) for k in (*LOST, "productive_s")}
    total["wall_s"] = attempts[-1].end - attempts[0].start if attempts else 0.0
    total["ettr"] = total["productive_s"] / total["wall_s"] if total["wall_s"] > 0 else 0.0
    total["attempts"] = float(len(attempts))
    return rows, total


def table(attempts: list[Attempt]) -> str:
    """The ledger as a Markdown table: one row per attempt, then the job (seconds; ETTR as a percentage).

    An attempt that never recorded its end though a later one started (killed, crashed, its node lost) is ``died``.
    """
    rows, total = summarize(attempts)
    cols = ("wall_s", "productive_s", *LOST)
    head = ["attempt", "status", "steps", *(c.removesuffix("_s") for c in cols), "ETTR %"]
    lines = [f"| {' | '.join(head)} |", "|---|---|---|" + "---:|" * (len(cols) + 1)]
    for i, (a, row) in enumerate(zip(attempts, rows, strict=True)):
        wall = row["wall_s"] + row["gap_s"]
        status = "died" if a.status == "running" and i + 1 < len(attempts) else a.status  # it never recorded its end
        ettr = 100 * row["productive_s"] / wall if wall > 0 else 0.0
        cells = [str(a.attempt), status, f"{a.resumed_step}-{a.last_step}", *(f"{row[c]:.1f}" for c in cols)]
        lines.append(f"| {' | '.join([*cells, f'{ettr:.1f}'])} |")
    last = attempts[-1].last_step if attempts else 0
    cells = ["job", "", f"0-{last}", *(f"{total[c]:.1f}" for c in cols), f"{100 * total['ettr']:.1f}"]
    lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


class Ledger:
    """The live record of this attempt, with the records of the job's earlier attempts.

    Time is charged from a mark that moves forward: each :meth:`charge` gives the time since the mark to one bucket,
    less what :meth:`note` took out of it for others (a blocking save inside a step, its data wait), so the buckets
    always add up to the attempt's wall time. ``write`` (rank 0: the job directory's writer; None: no record) is
    called with this attempt's record by :meth:`flush`: at every log interval and checkpoint.
    """

    def __init__(self, attempt: Attempt, previous: list[Attempt], write: Callable[[Attempt], None] | None) -> None:
        self.attempt, self.previous, self.write = attempt, previous, write
        self._mark = attempt.end
        self._noted: dict[str, float] = {}
        self._saving: int | None = None
        self._first_step = True
        self._write_failed = False

    @classmethod
    def begin(
        cls,
        previous: list[Attempt],
        process_start: float,
        resumed_step: int,
        load_s: float,
        write: Callable[[Attempt], None] | None = None,
        now: float | None = None,
    ) -> Ledger:
        """This attempt's ledger once its checkpoint is loaded: start-up so far charged and the record written."""
        number = previous[-1].attempt + 1 if previous else 0
        ledger = cls(Attempt(number, process_start, process_start, resumed_step, resumed_step), previous, write)
        ledger.note("load_s", load_s)
        ledger.charge("startup_s", now)
        ledger.flush()
        return ledger

    def note(self, bucket: str, seconds: float) -> None:
        """Give ``seconds`` of the time up to the next :meth:`charge` to ``bucket`` instead."""
        self._noted[bucket] = self._noted.get(bucket, 0.0) + max(0.0, seconds)

    def charge(self, bucket: str, now: float | None = None) -> None:
        """Give the time since the last charge to ``bucket``, less what was noted for other buckets."""
        now = time.time() if now is None else now
        elapsed, noted = max(0.0, now - self._mark), sum(self._noted.values())
        shrink = elapsed / noted if noted > elapsed else 1.0  # two clocks that disagree: never count a second twice
        a = self.attempt
        for name, seconds in self._noted.items():
            setattr(a, name, getattr(a, name) + seconds * shrink)
        setattr(a, bucket, getattr(a, bucket) + elapsed - noted * shrink)
        self._mark, self._noted, a.end = now, {}, now

    def saving(self, step: int) -> None:
        """A checkpoint of ``step`` is being written: remember the step time a restart from it keeps."""
        if step == self.attempt.last_step:  # the step is accounted already (the checkpoint of a preemption)
            self.attempt.at_step[step] = self.attempt.steps_s
        else:  # the step's own checkpoint hook: its time is charged when it ends
            self._saving = step

    def step_end(self, step: int, data_wait_s: float, now: float | None = None) -> None:
        """Step ``step`` has ended (its data wait inside); an attempt's first step is start-up (compile)."""
        self.note("data_wait_s", data_wait_s)
        self.charge("startup_s" if self._first_step else "steps_s", now)
        self._first_step = False
        self.attempt.last_step = step
        if self._saving == step:
            self.attempt.at_step[step] = self.attempt.steps_s
            self._saving = None
            self.flush()

    def rewind(self, step: int, now: float | None = None) -> None:
        """A rollback to the checkpoint of ``step``: the step time since then is replayed work."""
        self.charge("steps_s", now)
        a = self.attempt
        a.rolled_back_s += a.steps_s - a.kept_s(step)
        a.at_step = {k: v for k, v in a.at_step.items() if k < step} | {step: a.steps_s}  # from here on, as saved
        a.last_step = step
        self.flush()

    def finish(self, status: str) -> None:
        """The attempt ends (``finished``, ``preempted``, ``failed``); its record says so."""
        self.attempt.status = status
        self.flush()

    def flush(self) -> None:
        """Write this attempt's record (rank 0); a failed write is logged once and never stops training."""
        if self.write is None:
            return
        try:
            self.write(self.attempt)
        except OSError as e:
            if not self._write_failed:
                log.warning("could not write the goodput ledger (%s); the next attempt will count this one as a gap", e)
            self._write_failed = True

    def attempts(self) -> list[Attempt]:
        """The job's attempts so far, this one last."""
        return [*self.previous, self.attempt]

    def metrics(self) -> dict[str, float]:
        """``goodput/*``: the job's totals so far (seconds), its ETTR and its number of attempts."""
        _, total = summarize(self.attempts())
        return {f"goodput/{k}": v for k, v in total.items()}

    def table(self) -> str:
        """The job's ledger as a Markdown table."""
        return table(self.attempts())


def process_start() -> float:
    """When this process started, on ``time.time()``'s scale, to ~10 ms on Linux.

    psutil's ``create_time`` adds the process's age to the boot time, which Linux gives in whole seconds: up to a
    second off, as much as a short gap between two attempts. ``/proc/uptime`` (centiseconds) gives the age itself.
    """
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


def write_ledger(ledger: Ledger, out_dir: Path) -> list[Path]:
    """``goodput.md`` (the table) and ``goodput.json`` (the records, rows and totals) of the job, in ``out_dir``."""
    attempts = ledger.attempts()
    rows, total = summarize(attempts)
    md, js = out_dir / "goodput.md", out_dir / "goodput.json"
    md.write_text(f"# Goodput ledger (seconds)\n\n{table(attempts)}\n")
    records = [a.to_dict() for a in attempts]
    js.write_text(json.dumps({"attempts": records, "rows": rows, "job": total}, indent=1))
    return [md, js]
