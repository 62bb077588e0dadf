"""A run's hooks around ``fit``, built in one place: what runs after every step, in the order it runs.

The trainer drives them around ``fit`` but builds none of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hlat import checkpoint
from hlat.backends.base import Backend, Env
from hlat.config import RunConfig
from hlat.data import Loader
from hlat.health.monitors import Monitors
from hlat.launch import preempt
from hlat.state import NULL_TIMER, Hook, NonFiniteError, NullTimer, StepOutput, StepTimer, TrainState
from hlat.track.goodput import Ledger
from hlat.track.metrics import MetricsLogger, SpikeDetector, Uptime
from hlat.train import evals
from hlat.train.faults import fault_hooks
from hlat.train.loop import timed_hook
from hlat.train.resume import JobStart
from hlat.train.tracking import Tracking


@dataclass
class Hooks:
    """``fit``'s hooks in their order, and the ones the trainer also drives around ``fit`` (start, flush, close)."""

    loop: list[Hook]
    """After every step: progress, metrics, the guard, checkpoints, monitors, faults, the goodput ledger, then the stop
    hook."""
    grad: list[Callable[[int, nn.Module], None]]
    """While a step's gradients exist (per-layer gradient norms, injected NaN gradients)."""
    timer: StepTimer | NullTimer
    logger: MetricsLogger
    saver: checkpoint.Checkpointer
    monitors: Monitors
    evals: evals.EvalScheduler | None
    """Evaluations of the checkpoints along training (rank 0, ``eval.every_tokens``), or None."""
    stop: preempt.StopHook


class NonFiniteGuard:
    """Loop hook of ``train.on_nonfinite`` halt/rollback: raise on a non-finite step the logger has fetched.

    The logger fetches every log interval and before every save, so no non-finite state is ever checkpointed.
    """

    def __init__(self, policy: str, logger: MetricsLogger) -> None:
        self.policy, self.logger = policy, logger

    def __call__(self, state: TrainState, out: StepOutput | None = None) -> None:
        if self.policy != "skip_step" and self.logger.first_nonfinite is not None:
            raise NonFiniteError(self.logger.first_nonfinite)


@dataclass
class CheckpointContent:
    """What a checkpoint holds besides the weights and optimizer: progress, data position, RNG, spikes, job record."""

    logger: MetricsLogger
    guard: NonFiniteGuard
    tracking: Tracking
    uptime: Uptime
    data: Loader
    spikes: SpikeDetector

    def __call__(self, state: TrainState) -> dict:
        if self.uptime.ledger is not None:  # a restart from this checkpoint keeps the step time up to it
            self.uptime.ledger.saving(state.step)
        self.logger.flush(state)  # the spike statistics and productive time in the checkpoint cover every step up to it
        self.guard(state)  # never checkpoint a non-finite state
        self.tracking.checkpointed(state.step)  # the full-resolution series up to this step is on disk
        if self.tracking.mlflow is not None:  # the metrics up to this step are in MLflow or in the spool on disk
            self.tracking.mlflow.sync()  # before the checkpoint is complete (a restart replays only later steps)
        record = {"mlflow_run_id": self.tracking.run_id, "uptime": self.uptime.state_dict()}  # a restart continues it
        return {
            "train_state": dataclasses.asdict(state),
            "data": self.data.state_dict(),
            "rng": torch.get_rng_state(),
            "spikes": self.spikes.state_dict(),
            "job": record,
        }


def build_hooks(
    cfg: RunConfig,
    backend: Backend,
    env: Env,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Loader,
    spikes: SpikeDetector,
    uptime: Uptime,
    tracking: Tracking,
    job: JobStart,
    run_dir: Path,
    first_tokens: int,
) -> Hooks:
    """Build the run's hooks, in the order the ranks must (monitors, faults and the stop hook make process groups).

    ``first_tokens``: the tokens already seen when this start began (a resumed run evaluates from there).
    """
    t = cfg.train
    tokens_per_step = t.global_batch_size * t.seq_len
    timer = StepTimer(backend.synchronize) if t.step_breakdown else NULL_TIMER
    logger = _metrics_logger(cfg, backend, model, data, spikes, uptime, tracking, timer)
    faults = fault_hooks(cfg.fault, t.steps, job.root / "faults", env.rank)
    scheduler = evals.scheduler(cfg, tokens_per_step, first_tokens) if env.rank == 0 else None
    guard = NonFiniteGuard(t.on_nonfinite, logger)
    config = dataclasses.asdict(cfg)
    saver = checkpoint.Checkpointer(
        backend,
        job.root,
        model,
        optimizer,
        CheckpointContent(logger, guard, tracking, uptime, data, spikes),
        every=t.checkpoint_every,
        last_step=t.steps,
        keep_last=t.keep_last,
        keep_every=t.keep_every,
        meta={"config": config, "config_hash": checkpoint.config_hash(config)},
        async_save=t.async_checkpoint,
        fault=faults.on_save,
        rank=env.rank,
        on_saved=scheduler,
    )
    monitors = Monitors(cfg, env, model, run_dir, tracking.tracker.log_metrics, backend.graph_ledger())
    stop = preempt.StopHook(preempt.SignalFlag(), t.steps, distributed=env.world_size > 1)  # collective
    if monitors.graphs is not None:  # a graph divergence stops every rank at the same step boundary
        stop.stops.append(monitors.graphs.stop_request)
    marked = monitors.marking(timer)  # the heartbeat learns each phase of the step from the step's timer
    ledger = uptime.ledger
    loop = [
        tracking.progress,
        timed_hook(marked, "logging", logger),
        guard,
        ledger_timed(ledger, "save_s", timed_hook(marked, "checkpoint", saver)),
        *monitors.hooks,
        *faults.loop,
        LedgerHook(ledger, t.log_every, t.steps) if ledger is not None else None,
        stop,
    ]
    grad = ([logger.capture_grads] if cfg.tracker.layer_grad_norms_every else []) + faults.grad
    return Hooks([h for h in loop if h is not None], grad, marked, logger, saver, monitors, scheduler, stop)


def ledger_timed(ledger: Ledger | None, bucket: str, hook: Hook) -> Hook:
    """``hook`` with the time of its calls given to the goodput ledger's ``bucket`` (the blocking part of a save)."""
    if ledger is None:
        return hook

    def run(state: TrainState, out: StepOutput) -> None:
        started = time.time()
        try:
            hook(state, out)
        finally:
            ledger.note(bucket, time.time() - started)

    return run


@dataclass
class LedgerHook:
    """Loop hook, after all but the stop hook: the step has ended, in the goodput ledger.

    Its record is written every ``every`` steps (and at checkpoints): a process killed between two keeps what it knew.
    """

    ledger: Ledger
    every: int
    last_step: int

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        self.ledger.step_end(state.step, out.data_wait_s)
        if state.step % self.every == 0 or state.step == self.last_step:
            self.ledger.flush()


def _metrics_logger(
    cfg: RunConfig,
    backend: Backend,
    model: nn.Module,
    data: Loader,
    spikes: SpikeDetector,
    uptime: Uptime,
    tracking: Tracking,
    timer: StepTimer | NullTimer,
) -> MetricsLogger:
    """The run's metrics logger: every ``train.log_every`` steps, one fetch and one row per step into the tracker."""
    t = cfg.train
    return MetricsLogger(
        backend,
        model,
        tracking.tracker.log_metrics,
        every=t.log_every,
        last_step=t.steps,
        tokens_per_step=t.global_batch_size * t.seq_len,
        seq_len=t.seq_len,
        extra=lambda: {**data.stats(), **backend.host_metrics()},
        spikes=spikes,
        spike_summary_every=cfg.tracker.spike_summary_every,
        throughput=tracking.throughput,
        uptime=uptime,
        layer_norms_every=cfg.tracker.layer_grad_norms_every,
        timer=timer,
        interval=data.interval,
    )
