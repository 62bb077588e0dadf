"""The assembled training loop: ``fit`` with its hooks, and what happens around it.

Built from what :func:`hlat.train.run.main` made (backend, model, optimizer, data, tracking), a :class:`Trainer`
wires the hooks (progress, metrics, the non-finite guard, checkpoints, monitors, fault injection, the signal stop)
and runs ``fit``: a non-finite step rolls back to the last checkpoint (``train.on_nonfinite``), a signal stops at the
next step boundary with a checkpoint of it (``hlat.train.preempt``), and whatever happens the checkpoint in flight
completes and every tracker, monitor and lock is closed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from hlat.backends.base import Backend, Env
from hlat.config import RunConfig
from hlat.health.monitors import Monitors
from hlat.optim import lr_at
from hlat.parallel import ParallelDims
from hlat.state import NULL_TIMER, NonFiniteError, StepTimer, TrainState
from hlat.track.metrics import MetricsLogger, SpikeDetector, Uptime
from hlat.train import checkpoint, evals, preempt
from hlat.train.faults import FaultInjector
from hlat.train.loop import fit, timed_hook
from hlat.train.resume import JobStart, restore, rollback
from hlat.train.tracking import Tracking

log = logging.getLogger(__name__)


@dataclass
class Trainer:
    """``fit`` over the built objects, with its hooks; :meth:`run` trains, :meth:`report` says how it went."""

    cfg: RunConfig
    backend: Backend
    env: Env
    dims: ParallelDims
    model: Any
    optimizer: Any
    data: Any
    """The batch loader (its position is checkpointed)."""
    spikes: SpikeDetector
    uptime: Uptime
    tracking: Tracking
    job: JobStart
    run_dir: Path
    first_tokens: int = 0
    """Tokens already seen when this start began (a resumed run evaluates from there)."""
    lock: Any = None
    """The trainer lock on the checkpoint directory (rank 0), released when the run ends."""
    saver: checkpoint.Checkpointer = field(init=False)
    logger: MetricsLogger = field(init=False)

    def __post_init__(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        self.timer = StepTimer(self.backend.synchronize) if t.step_breakdown else NULL_TIMER
        self.logger = MetricsLogger(
            self.backend, self.model, self.tracking.tracker.log_metrics, every=t.log_every, last_step=t.steps,
            tokens_per_step=tokens_per_step, seq_len=t.seq_len,
            extra=lambda: {**self.data.stats(), **self.backend.host_metrics()}, spikes=self.spikes,
            spike_summary_every=cfg.tracker.spike_summary_every, throughput=self.tracking.throughput,
            uptime=self.uptime, layer_norms_every=cfg.tracker.layer_grad_norms_every, timer=self.timer,
        )  # fmt: skip
        rank0 = self.env.rank == 0
        self.faults = (FaultInjector(cfg.fault, t.steps, self.job.root / "faults", self.env.rank)
                       if cfg.fault.active else None)  # fmt: skip
        self.evals = evals.scheduler(cfg, tokens_per_step, self.first_tokens) if rank0 else None
        config = dataclasses.asdict(cfg)
        self.saver = checkpoint.Checkpointer(
            self.backend, self.job.root, self.model, self.optimizer, self._checkpoint_extra, every=t.checkpoint_every,
            last_step=t.steps, keep_last=t.keep_last, keep_every=t.keep_every,
            meta={"config": config, "config_hash": checkpoint.config_hash(config)}, async_save=t.async_checkpoint,
            fault=self.faults.on_save if self.faults else None, rank=self.env.rank, on_saved=self.evals,
        )  # fmt: skip
        self.monitors = Monitors(cfg, self.env, self.model, self.run_dir, self.tracking.tracker.log_metrics)
        self.flag = preempt.SignalFlag()
        self.stop = preempt.StopHook(self.flag, t.steps, distributed=self.env.world_size > 1)  # collective
        self.fit = self._fit_function(tokens_per_step)

    def _fit_function(self, tokens_per_step: int) -> Any:
        """``fit`` with every argument but the state bound: the hooks in their order, the LR schedule, the policy."""
        cfg, t, faults = self.cfg, self.cfg.train, self.faults
        timer = self.monitors.marking(self.timer)  # the heartbeat learns each phase of the step from it
        hooks = [self.tracking.progress, timed_hook(timer, "logging", self.logger), self._guard,
                 timed_hook(timer, "checkpoint", self.saver), *self.monitors.hooks, faults, self.stop]  # fmt: skip
        return functools.partial(
            fit, model=self.model, optimizer=self.optimizer, data=iter(self.data), backend=self.backend,
            steps=t.steps, grad_accum=self.dims.grad_accum(t), clip_grad_norm=cfg.optimizer.clip_grad_norm,
            tokens_per_step=tokens_per_step, lr_fn=functools.partial(lr_at, cfg=cfg.optimizer, total_steps=t.steps),
            hooks=[h for h in hooks if h is not None],
            grad_hooks=([self.logger.capture_grads] if cfg.tracker.layer_grad_norms_every else [])
            + ([faults.poison_grads] if faults else []),
            skip_nonfinite=t.on_nonfinite == "skip_step", timer=timer,
        )  # fmt: skip

    def _guard(self, s: TrainState, out: Any = None) -> None:
        """halt/rollback: act on a non-finite step the logger has fetched (every log interval, before every save)."""
        if self.cfg.train.on_nonfinite != "skip_step" and self.logger.first_nonfinite is not None:
            raise NonFiniteError(self.logger.first_nonfinite)

    def _checkpoint_extra(self, s: TrainState) -> dict:
        """What a checkpoint holds besides the weights and optimizer: progress, data position, RNG, spikes, job."""
        self.logger.flush(s)  # the spike statistics and productive time in the checkpoint cover every step up to it
        self._guard(s)  # never checkpoint a non-finite state
        if self.tracking.mlflow is not None:  # the metrics up to this step reach MLflow before the checkpoint is
            self.tracking.mlflow.sync()  # complete: a restart from it replays only later steps, so none is missing
        record = {"mlflow_run_id": self.tracking.run_id, "uptime": self.uptime.state_dict()}  # a restart continues it
        return {"train_state": dataclasses.asdict(s), "data": self.data.state_dict(), "rng": torch.get_rng_state(),
                "spikes": self.spikes.state_dict(), "job": record}  # fmt: skip

    def _fit_with_rollback(self, state: TrainState) -> TrainState:
        """``fit`` until the last step; a non-finite step goes back to the last checkpoint (or halts)."""
        reload = functools.partial(restore, self.backend, model=self.model, optimizer=self.optimizer, data=self.data,
                                   spikes=self.spikes)  # fmt: skip
        while True:
            try:
                return self.fit(state)
            except NonFiniteError as e:
                state = rollback(e, state, self.cfg.train.on_nonfinite, self.saver, self.job.root, self.logger,
                                 self.uptime, reload)  # fmt: skip
                if self.tracking.progress is not None:
                    self.tracking.progress.reset()

    def run(self, state: TrainState) -> TrainState:
        """Train from ``state`` to ``train.steps``; a signal stops at the next step with a checkpoint of it.

        Raises:
            PreemptedError: A signal stopped the run and the checkpoint of the step in flight is complete.
            HaltedError: A non-finite step under ``on_nonfinite=halt``, or a rollback with nowhere to go.
            EvalFailedError: Training finished but an evaluation along it failed (``eval.on_error=fail``).
        """
        t, rank0 = self.cfg.train, self.env.rank == 0
        status, stopped = "FAILED", None
        with self.flag:  # SIGTERM, SIGINT, SIGUSR1/2 stop training at the next step boundary, with a checkpoint
            try:
                self.monitors.start(state.step)
                self.logger.start(psutil.Process().create_time())
                state = self._fit_with_rollback(state)
                self.saver.close()
                if self.evals is not None:  # their scores are in the run before it ends; a failed one fails it
                    self.evals.finish()
                status = "FINISHED"
                if rank0 and self.cfg.tracker.plots:
                    self.tracking.plot(self.spikes, self.run_dir / "plots")
            except preempt.PreemptedError as e:
                status = "KILLED"
                self.monitors.close()  # the hang watchdog must not time the save
                stopped = preempt.checkpoint_now(e, self.saver, state, t.preempt_grace_s)
                if rank0:
                    preempt.record(stopped, self.run_dir, self.tracking.mlflow)
                self.stop.barrier()  # no rank exits before rank 0 completed the checkpoint (a launcher may kill all)
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
        self.monitors.close()
        self.stop.close()
        if status != "FINISHED":
            try:  # let a save in flight complete: it is the state a restart resumes from
                self.saver.close()
            except Exception:
                log.exception("the checkpoint in flight failed as well")
        self.data.close()
        self.tracking.tracker.finish(status)
        if self.lock is not None:
            self.lock.close()
        if self.evals is not None:
            self.evals.close()  # the evaluations along training log into this run: let them finish

    def report(self, state: TrainState) -> None:
        """Rank 0 prints the run's outcome: steps, tokens, loss first -> last, the checkpoint, the MLflow address."""
        if self.env.rank != 0:
            return
        losses = self.tracking.history.series("train/loss") or [(0, float("nan"))]
        print(f"trained {state.step} steps, {state.tokens_seen:,} tokens: "
              f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")  # fmt: skip
        if self.saver.last_saved is not None:
            print(f"checkpoint: {self.saver.last_saved}")
        if self.tracking.mlflow is not None:
            print(self.tracking.mlflow.ui_hint())
