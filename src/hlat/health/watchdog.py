"""The hang watchdog: a step far slower than usual is reported, naming the rank it is about, and ends the trainer.

A hung collective or deadlock does not raise. A daemon thread sees the step outrun its threshold, names the rank from
the heartbeats, dumps every thread's stack, waits for the others to dump theirs, and ``os._exit``s for torch elastic
to restart. It needs the GIL: a hang in C code holding it is left to ``health.collective_timeout_s``.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlat.config import HealthConfig
from hlat.health import blame
from hlat.health.heartbeat import Heartbeat

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75
"""Exit code of a trainer the watchdog ended (EX_TEMPFAIL: a temporary failure, retrying may work). Torch elastic
restarts a worker group on any non-zero exit; ``hlat.train.entry`` names this one in its report."""
WINDOW = 50
"""Recent step durations whose median sets the threshold."""
PY_SPY_TIMEOUT_S = 60.0


class HangWatchdog:
    """Loop hook plus daemon thread: detects a step that runs far longer than the recent median.

    After ``last_step`` it stands down (the final save and evaluations are not steps); ``dump_dir`` is created on
    the first hang only.
    """

    def __init__(
        self,
        cfg: HealthConfig,
        dump_dir: Path,
        rank: int,
        last_step: int,
        *,
        heartbeat: Heartbeat | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.dump_dir, self.rank, self.last_step = cfg, Path(dump_dir), rank, last_step
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat(rank)
        self.exit_fn, self.clock = exit_fn, clock
        self.durations: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.beats = 0
        self.step = 0  # the last completed step
        self.last_beat = clock()
        self.fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int = 0) -> HangWatchdog:
        """Start the watching thread and the heartbeat; training resumes after ``step``, whose clock starts now."""
        with self._lock:
            self.step, self.last_beat = step, self.clock()
        self.heartbeat.start(step)
        self._thread = threading.Thread(target=self._run, name="hlat-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (idempotent); call it when training ends, however it ends."""
        self._stop.set()
        self.heartbeat.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __call__(self, state: Any, out: Any = None) -> None:
        """Loop hook: step ``state.step`` is done (host clock only, no device access)."""
        now = self.clock()
        with self._lock:
            if self.beats >= 1:  # the first interval holds start-up and compilation: not a typical step
                self.durations.append(now - self.last_beat)
            self.beats += 1
            self.step, self.last_beat = state.step, now
        self.heartbeat.stepped(state.step)
        if state.step >= self.last_step:
            self.close()

    def median(self) -> float | None:
        """Median duration in seconds of the recent steps (None before the second step has ended)."""
        with self._lock:
            return statistics.median(self.durations) if self.durations else None

    def threshold(self) -> float:
        """Seconds the current step may run before it counts as hung."""
        median = self.median()
        if self.beats < 2 or median is None:
            return self.cfg.watchdog_first_step_s
        return max(self.cfg.watchdog_factor * median, self.cfg.watchdog_floor_s)

    def check(self) -> bool:
        """Fire if the current step has run past the threshold; returns whether it fired (one check of the thread)."""
        if self.fired or self._stop.is_set():
            return self.fired
        with self._lock:
            elapsed, step = self.clock() - self.last_beat, self.step + 1
        limit = self.threshold()
        if elapsed > limit:
            self.fire(step, elapsed, limit)
        return self.fired

    def _run(self) -> None:
        # Poll often enough to fire within ~5% of the threshold, at most once a second.
        while not self._stop.wait(min(1.0, max(0.05, self.threshold() / 20))):
            if self.check():
                return

    def fire(self, step: int, elapsed: float, limit: float) -> None:
        """Name the rank(s) the hang is about, dump the stacks, say it, wait for the other ranks, then exit."""
        self.fired = True
        path = self.dump_dir / f"rank{self.rank}.txt"
        median = self.median()
        why = (
            f"step {step} has run {elapsed:.1f}s, more than the watchdog's {limit:.1f}s "
            f"(max(health.watchdog_factor={self.cfg.watchdog_factor:g} x median step "
            f"{'n/a' if median is None else f'{median:.3f}s'}, health.watchdog_floor_s="
            f"{self.cfg.watchdog_floor_s:g}) or health.watchdog_first_step_s={self.cfg.watchdog_first_step_s:g} "
            "for the first steps)"
        )
        said, report = self.report(step, why, limit, elapsed)
        try:
            dump_stacks(path, f"rank {self.rank}, pid {os.getpid()}: {why}")
        except OSError as e:  # a full or unreachable disk must not stop the exit that lets elastic restart us
            log.error("could not write the stacks to %s: %s", path, e)
        message = (
            f"hang: {said}. Seen by rank {self.rank} on {self.heartbeat.host}: {why}. What every rank was "
            f"doing: {report}; this rank's stacks: {path}. Exiting with code {HANG_EXIT_CODE} so that torch "
            "elastic restarts the job from its newest checkpoint (cluster.max_restarts)"
        )
        log.error("%s", message)
        for h in logging.getLogger().handlers:
            h.flush()
        grace = max(self.cfg.watchdog_grace_s, 2 * (median or 0.0))
        self._stop.wait(grace)  # the heartbeat goes on: this rank is alive, waiting
        self.exit_fn(HANG_EXIT_CODE)

    def report(self, step: int, why: str, limit: float, elapsed: float) -> tuple[str, Path | str]:
        """The verdict drawn from every rank's heartbeat, appended to ``<dump dir>/report.txt``; it and the file."""
        hb = self.heartbeat
        stale_s = blame.stale_after(limit, hb.every_s)
        if hb.board is not None:  # other ranks to judge
            # A rank that stopped when this step began has a beat about `elapsed` old: under a short threshold, wait
            # until it is older than the staleness bound (plus a beat period, for the live ranks to beat again).
            self._stop.wait(max(0.0, stale_s + hb.every_s - elapsed))
        beats, unread = hb.read()
        now = hb.wall()
        v = blame.judge(beats, self.rank, now, stale_s, unread)
        header = f"rank {self.rank} on {hb.host} (pid {hb.pid}): {why}"
        extra = {"rank": self.rank, "host": hb.host, "attempt": hb.attempt, "step": step}
        try:
            return v.said, blame.write_report(self.dump_dir, header, v, extra)
        except OSError as e:
            log.error("could not write the hang report to %s: %s", self.dump_dir, e)
            return v.said, "(not written)"


def dump_stacks(path: Path, header: str) -> None:
    """Append ``header``, every thread's Python stack (faulthandler) and, if installed, ``py-spy dump`` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n--- faulthandler (all threads)\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write(py_spy_dump(os.getpid()))
        f.write("\n")


def py_spy_dump(pid: int) -> str:
    """``py-spy dump --pid pid`` (native frames too) when py-spy is on the PATH; a note why not otherwise."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "--- py-spy: not installed (pip install py-spy for native frames)\n"
    _allow_ptrace_by_children()
    try:
        r = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"--- py-spy dump failed: {e}\n"
    return f"--- py-spy dump (exit {r.returncode})\n{r.stdout}{r.stderr}"


def _allow_ptrace_by_children() -> None:
    """Let a child (py-spy) read this process's memory where Yama restricts ptrace to ancestors (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
    with contextlib.suppress(OSError, AttributeError):  # no prctl: py-spy then needs CAP_SYS_PTRACE
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0)
