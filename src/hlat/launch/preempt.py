"""Preemption and interrupts: a signal stops training at the next step boundary, with a checkpoint of that step.

:class:`SignalFlag` records SIGTERM, SIGINT, SIGUSR1 or SIGUSR2; :class:`StopHook` makes the ranks agree on it at the
step boundary and raises :class:`PreemptedError`; the run then saves (:func:`checkpoint_now`), leaves
:data:`MARKER` and exits :data:`PREEMPTED_EXIT_CODE`. docs/fault-recovery.md tells the whole path. Imports nothing of
hlat.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 85
"""Exit code of a trainer (or of its torch elastic agent) that stopped on a signal with a checkpoint of the step in
flight: rerun the printed command, or let the launcher requeue it, to continue. (75 is the hang watchdog's.)"""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that stop training at the next step boundary."""
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
"""What a torch elastic agent turns into a shutdown that forwards the signal to its workers: torch's default
(SIGTERM, SIGINT, SIGHUP, SIGQUIT) plus Slurm's warning signals (``torchrun --signals-to-handle``)."""
MARGIN_S = 10
"""Seconds a launcher waits beyond ``train.preempt_grace_s`` before it kills the trainer (agent teardown, slack)."""
REPEAT_S = 1.0
"""A second SIGINT sooner than this after the first is the same Ctrl-C, delivered twice; later, it aborts."""
MARKER = "preempted.json"
"""In the run directory: written by rank 0 once the checkpoint of a preempted run is complete."""
TAGS = ("hlat.preempted", "hlat.resumable")
"""MLflow tags of a run that stopped preempted; ``hlat.resumable`` goes away when the run is continued."""


def launcher_grace_s(grace_s: float) -> int:
    """Whole seconds a launcher gives a signalled trainer before SIGKILL: ``grace_s`` + :data:`MARGIN_S`."""
    return math.ceil(grace_s) + MARGIN_S


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptedError(Exception):
    """Training stopped on a signal at a step boundary; the checkpoint of ``step`` holds the run. Rerun to continue."""

    def __init__(
        self, signum: int, step: int, received_at: float, checkpoint: str | None = None, elapsed_s: float | None = None
    ) -> None:
        self.signum, self.step, self.received_at = signum, step, received_at
        self.checkpoint, self.elapsed_s = checkpoint, elapsed_s
        super().__init__(signum, step)

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """One line: what stopped the run, where, and what was saved."""
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        took = f", {self.elapsed_s:.1f} s after the signal" if self.elapsed_s is not None else ""
        return f"preempted by {signal_name(self.signum)} after step {self.step}{saved}{took}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": signal_name(self.signum),
            "signum": self.signum,
            "step": self.step,
            "checkpoint": self.checkpoint,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreemptedError:
        return cls(int(d["signum"]), int(d["step"]), 0.0, d.get("checkpoint"), d.get("elapsed_s"))


class AbortedError(Exception):
    """A supervised job was stopped by a signal before its trainers wrote a checkpoint (or aborted on a second one)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)} before a checkpoint of the step in flight was written")


class SignalFlag:
    """Signal handlers that only record the first of :data:`SIGNALS`; ``with flag:`` brackets training.

    Attributes:
        signum: The first signal received (None until one is).
        received_at: ``time.monotonic()`` when it came.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def install(self) -> None:
        """Take over :data:`SIGNALS` (main thread only; elsewhere nothing changes)."""
        for s in SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: signals are the main thread's business
                return

    def restore(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            # os.write: no logging lock is taken inside a signal handler
            os.write(2, f"hlat: {signal_name(signum)}: stopping after the step in flight, with a checkpoint\n".encode())
        elif signum == signal.SIGINT and now - self.received_at > REPEAT_S:
            raise KeyboardInterrupt  # the second Ctrl-C: abort, without the checkpoint


class StopHook:
    """Loop hook: at every step boundary the ranks agree whether any got a signal; then it raises PreemptedError.

    Other stops (``stops``: the graph divergence guard) ride on the same agreement, so every rank raises together.

    With several ranks that is one all-reduce (MAX) of a 0-d integer over a gloo group, on the host (no device
    synchronisation); with one rank no collective. Construct it on every rank at the same point (the group is
    created collectively). The last step is left alone: that run is finishing anyway, with its final checkpoint.

    Args:
        flag: This process's signal flag.
        last_step: ``train.steps``.
        distributed: Whether there are several ranks (torch.distributed is initialized).
    """

    def __init__(self, flag: SignalFlag, last_step: int, distributed: bool) -> None:
        self.flag, self.last_step = flag, last_step
        self.stops: list[Callable[[bool], BaseException | None]] = []
        """Other reasons to stop every rank at the same step: ``stop(False)`` is this rank's error if it wants to
        stop, ``stop(True)`` (once any rank wanted to) the error to raise, or None (the graph divergence guard)."""
        self._group: Any = None
        if distributed:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # host values, whatever the device backend

    def __call__(self, state: Any, out: Any = None) -> None:
        if state.step >= self.last_step:
            return
        signum = self.flag.signum or 0
        wanted = int(any(stop(False) is not None for stop in self.stops))
        if self._group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([signum, wanted], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            signum, wanted = int(t[0]), int(t[1])
        for stop in self.stops if wanted else ():
            if (error := stop(True)) is not None:
                raise error
        if signum:
            received = self.flag.received_at if self.flag.signum else time.monotonic()
            raise PreemptedError(signum, state.step, received)

    def barrier(self) -> None:
        """Wait for every rank (nothing with one): no rank exits before rank 0 has completed the checkpoint."""
        if self._group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._group)

    def close(self) -> None:
        """Destroy the gloo group (idempotent)."""
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None


def _save_due(saver: Any, step: int) -> bool:
    """Whether the checkpoint hook already started the save of ``step`` (``Checkpointer.__call__``'s rule)."""
    return step == saver.last_step or bool(saver.every and step % saver.every == 0)


def checkpoint_now(stop: PreemptedError, saver: Any, state: Any, grace_s: float) -> PreemptedError:
    """Write the checkpoint of the step in flight, synchronously, after any save in flight; every rank calls it.

    Args:
        stop: What the stop hook raised.
        saver: The run's ``hlat.checkpoint.Checkpointer``.
        state: The run's ``TrainState`` at the step boundary.
        grace_s: ``train.preempt_grace_s`` (a warning when the last checkpoint took longer than what is left of it).

    Returns:
        ``stop`` with the checkpoint (on rank 0; None elsewhere) and the seconds since the signal filled in.
    """
    t0 = time.monotonic()
    if saver.last_save_s is not None and saver.last_save_s > grace_s - (t0 - stop.received_at):
        log.warning(
            "the last checkpoint took %.1f s; it may not fit in what is left of train.preempt_grace_s=%g",
            saver.last_save_s,
            grace_s,
        )
    saver.wait()  # a save in flight completes first: it may be this very step's (the hook's)
    if not _save_due(saver, state.step):
        saver.async_save = False  # the process exits next: nothing may be left in a background thread
        saver.save(state)
    save_s = time.monotonic() - t0
    stop.checkpoint = str(saver.last_saved) if saver.last_saved is not None else None
    stop.elapsed_s = time.monotonic() - stop.received_at
    log.warning("%s (the save took %.2f s)", stop.describe(), save_s)
    return stop


def report(stop: PreemptedError, grace_s: float) -> None:
    """Once the run is closed (checkpoint, MLflow, loader): log how long stopping took; warn beyond the grace."""
    took = time.monotonic() - stop.received_at
    if took <= grace_s:
        log.info("stopped %.1f s after the signal (train.preempt_grace_s=%g)", took, grace_s)
        return
    log.warning(
        "stopping took %.1f s from the signal, more than train.preempt_grace_s=%g: a launcher that gives %d s "
        "may kill the trainer before it is done; raise train.preempt_grace_s",
        took,
        grace_s,
        launcher_grace_s(grace_s),
    )


def record(stop: PreemptedError, run_dir: Path, mlflow_tracker: Any) -> None:
    """Rank 0, once the checkpoint is complete: leave :data:`MARKER` and tag the MLflow run resumable."""
    path = run_dir / MARKER
    tmp = path.with_name(f".{MARKER}.tmp")
    tmp.write_text(json.dumps(stop.to_dict()) + "\n")
    os.replace(tmp, path)
    if mlflow_tracker is not None:  # sent from the tracker's thread: a tracking server that is away never holds it
        mlflow_tracker.set_tags({**dict.fromkeys(TAGS, "true"), "hlat.preempted_at_step": str(stop.step)})


def unmark(run_dir: Path, mlflow_tracker: Any) -> None:
    """Rank 0, as a run (re)starts: drop a stale :data:`MARKER` and the resumable tag of the run it continues."""
    clear_marker(run_dir)
    if mlflow_tracker is not None and mlflow_tracker.existing_params is not None:
        run = mlflow_tracker.client.get_run(mlflow_tracker.run_id)
        if "hlat.resumable" in run.data.tags:
            mlflow_tracker.client.delete_tag(mlflow_tracker.run_id, "hlat.resumable")


def clear_marker(run_dir: Path) -> None:
    """Remove :data:`MARKER` from ``run_dir`` (if there)."""
    (Path(run_dir) / MARKER).unlink(missing_ok=True)


def read_marker(run_dir: Path) -> PreemptedError | None:
    """The preemption rank 0 recorded in ``run_dir``, or None."""
    try:
        return PreemptedError.from_dict(json.loads((Path(run_dir) / MARKER).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def hand_over(signum: int) -> None:
    """After the checkpoint: let submitit requeue the job when ``signum`` is its preemption signal.

    Under Hydra's submitit launcher, submitit's handler of its signal (USR2) checkpoints the job's callable,
    requeues the Slurm job (``max_num_timeout`` times) and exits. hlat took the signal to save first; now that the
    checkpoint is complete, the handler that was there before (restored by :meth:`SignalFlag.restore`) runs.
    """
    handler = signal.getsignal(signum)
    owner = getattr(handler, "__self__", None)
    if getattr(handler, "__name__", "") == "checkpoint_and_try_requeue" and type(owner).__module__.startswith(
        "submitit"
    ):
        handler(signum, None)
