"""The training run around ``fit``: rollback on a non-finite step, the signal stop, and the cleanup however it ends.

However it ends, the checkpoint in flight completes and every tracker, monitor and lock is closed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from hlat.backends.base import Backend
from hlat.config import RunConfig
from hlat.data import Loader
from hlat.launch import preempt
from hlat.optim import lr_at
from hlat.parallel import ParallelDims
from hlat.state import NonFiniteError, TrainState
from hlat.track.goodput import write_ledger
from hlat.track.metrics import SpikeDetector, Uptime
from hlat.train.hooks import Hooks
from hlat.train.loop import fit
from hlat.train.resume import JobStart, restore, rollback
from hlat.train.tracking import Tracking

log = logging.getLogger(__name__)


@dataclass
class Trainer:
    """``fit`` over the built objects with their hooks; :meth:`run` trains, :meth:`report` says how it went."""

    cfg: RunConfig
    backend: Backend
    dims: ParallelDims
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Loader
    spikes: SpikeDetector
    uptime: Uptime
    tracking: Tracking
    hooks: Hooks
    job: JobStart
    run_dir: Path
    rank: int

    def _fit(self, state: TrainState) -> TrainState:
        """``fit`` from ``state`` to ``train.steps`` with the run's hooks and learning-rate schedule."""
        t, h = self.cfg.train, self.hooks
        return fit(
            state,
            self.model,
            self.optimizer,
            self.data,
            self.backend,
            steps=t.steps,
            grad_accum=self.dims.grad_accum(t),
            tokens_per_step=t.global_batch_size * t.seq_len,
            lr_fn=functools.partial(lr_at, cfg=self.cfg.optimizer, total_steps=t.steps),
            hooks=h.loop,
            grad_hooks=h.grad,
            timer=h.timer,
        )

    def _fit_with_rollback(self, state: TrainState) -> TrainState:
        """``fit`` until the last step; a non-finite step goes back to the last checkpoint (or halts)."""
        reload = functools.partial(
            restore, self.backend, model=self.model, optimizer=self.optimizer, data=self.data, spikes=self.spikes
        )
        while True:
            try:
                return self._fit(state)
            except NonFiniteError as e:
                state = rollback(
                    e,
                    state,
                    self.cfg.train.on_nonfinite,
                    self.hooks.saver,
                    self.job.root,
                    self.hooks.logger,
                    self.uptime,
                    reload,
                    self.job.checks,
                )
                if self.tracking.progress is not None:
                    self.tracking.progress.reset()

    def run(self, state: TrainState) -> TrainState:
        """Train from ``state`` to ``train.steps``; a signal stops at the next step with a checkpoint of it.

        Raises:
            PreemptedError: A signal stopped the run and the checkpoint of the step in flight is complete.
            HaltedError: A non-finite step under ``on_nonfinite=halt``, or a rollback with nowhere to go.
            EvalFailedError: Training finished but an evaluation along it failed (``eval.on_error=fail``).
        """
        t, h, rank0 = self.cfg.train, self.hooks, self.rank == 0
        status, stopped = "FAILED", None
        with h.stop.flag:  # SIGTERM, SIGINT, SIGUSR1/2 stop training at the next step boundary, with a checkpoint
            try:
                h.monitors.start(state.step)
                h.logger.start(psutil.Process().create_time())
                state = self._fit_with_rollback(state)
                h.saver.close()
                self._charge("save_s")  # the wait for the last save
                if h.evals is not None:  # their scores are in the run before it ends; a failed one fails it
                    h.evals.finish()
                    self._charge("eval_s")
                status = "FINISHED"
                self._record_goodput("finished", state.step)
                if rank0 and self.cfg.tracker.plots:
                    self.tracking.plot(self.spikes, self.run_dir / "plots")
            except preempt.PreemptedError as e:
                status = "KILLED"
                h.monitors.close()  # the hang watchdog must not time the save
                stopped = preempt.checkpoint_now(e, h.saver, state, t.preempt_grace_s)
                self._charge("save_s")
                self._record_goodput("preempted", state.step)
                if rank0:
                    preempt.record(stopped, self.run_dir, self.tracking.mlflow)
                h.stop.barrier()  # no rank exits before rank 0 completed the checkpoint (a launcher may kill all)
            except KeyboardInterrupt:  # a second Ctrl-C: abort without the checkpoint
                status = "KILLED"
                raise
            finally:
                self._close(status)
        if stopped is not None:
            preempt.report(stopped, t.preempt_grace_s)
            raise stopped
        return state

    def _close(self, status: str) -> None:
        """Whatever happened: let the save in flight complete, close monitors, data, tracker, lock, evaluations."""
        h = self.hooks
        ledger = self.uptime.ledger
        if ledger is not None and ledger.attempt.status == "running":  # failed, or a second Ctrl-C: its time since
            ledger.finish("failed" if status == "FAILED" else "interrupted")  # the last record is the gap after it
        h.monitors.close()
        h.stop.close()
        if status != "FINISHED":
            try:  # let a save in flight complete: it is the state a restart resumes from
                h.saver.close()
            except Exception:
                log.exception("the checkpoint in flight failed as well")
        self.data.close()
        self.tracking.tracker.finish(status)
        if self.job.lock is not None:
            self.job.lock.close()
        if h.evals is not None:
            h.evals.close()  # the evaluations along training log into this run: let them finish

    def _charge(self, bucket: str) -> None:
        """The time since the goodput ledger's last charge goes to ``bucket`` (the ends of the run)."""
        if self.uptime.ledger is not None:
            self.uptime.ledger.charge(bucket)

    def _record_goodput(self, status: str, step: int) -> None:
        """The attempt ends in its ledger; rank 0 logs the job's ``goodput/*`` and its ledger table into the run."""
        ledger = self.uptime.ledger
        if ledger is None:
            return
        ledger.finish(status)
        if self.rank != 0:
            return
        self.tracking.tracker.log_metrics([(step, ledger.metrics())])
        try:  # the table is a report: failing to write it must not change how the run ended
            for path in write_ledger(ledger, self.run_dir):
                self.tracking.tracker.log_artifact(path)
        except OSError:
            log.exception("could not write the goodput ledger into %s", self.run_dir)

    def report(self, state: TrainState) -> None:
        """Rank 0 prints the run's outcome: steps, tokens, loss first -> last, the checkpoint, the MLflow address."""
        if self.rank != 0:
            return
        losses = self.tracking.history.series("train/loss") or [(0, float("nan"))]
        print(
            f"trained {state.step} steps, {state.tokens_seen:,} tokens: loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}"
        )
        if self.hooks.saver.last_saved is not None:
            print(f"checkpoint: {self.hooks.saver.last_saved}")
        if self.tracking.mlflow is not None:
            print(self.tracking.mlflow.ui_hint())
