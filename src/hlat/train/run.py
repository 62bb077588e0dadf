"""Build everything from the run config, then fit: the build graph, read top to bottom in :func:`main`.

job -> backend -> layout and memory -> job checks -> data -> model -> optimizer -> state -> tracker -> hooks
(metrics, guard, checkpoints, monitors, faults, stop) -> fit -> report. Each step is one call to the package that owns
it, and what it makes is handed on explicitly; what to do when a step fails (exit codes, "how to continue" hints,
restarts) is the entry's (:mod:`hlat.train.entry`), which also turns Hydra's config into the ``RunConfig`` here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from hlat.backends import get_backend
from hlat.checkpoint.weights import initial_weights
from hlat.config import RunConfig
from hlat.data import build_loader
from hlat.experiments.information_leak import warn_mask_leak
from hlat.health.preflight import preflight
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from hlat.plan.memory import check_run, check_world, summary_text
from hlat.state import TrainState
from hlat.track.metrics import SpikeDetector
from hlat.track.trackers import History, check_reachable
from hlat.train import resume, tracking
from hlat.train.hooks import build_hooks
from hlat.train.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished (or dry) run returns to its caller."""

    config: RunConfig
    state: TrainState | None
    history: History
    mlflow_run_id: str | None


def main(cfg: RunConfig, run_dir: Path) -> RunResult:
    """Train as ``cfg`` says, into ``run_dir``: every object built here, in order, and handed on; then ``fit``."""
    t = cfg.train
    if t.dry_run:  # planned for the cluster's world, without touching a device: runs anywhere (`hlat summary`)
        print(summary_text(cfg))
        return RunResult(cfg, None, History(), None)
    launched = resume.begin(cfg, run_dir)  # first: the ranks agree which start of the job this is; it is counted
    backend = get_backend(cfg)
    env = backend.setup()
    check_world(cfg.cluster, env.world_size)  # a multi-node preset gets all its ranks, or its layout would change
    dims = ParallelDims.build(cfg.parallelism, env.world_size, cfg.model, t)  # the run's layout: built once, here
    matmuls = f"{env.bf16_matmul} ({env.bf16_matmul_reason})" if env.bf16_matmul else None
    n_params, est = check_run(cfg, dims, env.memory_budget_bytes, matmuls)  # before any allocation
    warn_mask_leak(cfg.model)
    job = resume.open_job(cfg, run_dir, est.params + est.optimizer, launched, env.rank)  # read-only checks, lock
    check_reachable(cfg.tracker, rank=env.rank)  # a dead tracker.uri fails now, not after building everything
    # Measure the devices and links before anything is built; a bad node fails every rank alike (PreflightError).
    health = preflight(cfg, env, out_dir=run_dir / "health", sync=backend.synchronize)

    data = build_loader(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
        dp_rank=dims.dp_rank(env.rank),
        dp_size=dims.dp,
        global_batch_size=t.global_batch_size,
        steps=t.steps,
    )
    init_state = initial_weights(cfg) if job.resume_from is None and t.init_from else None
    model = backend.build_model(dims, init_state)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer))
    spikes = SpikeDetector(cfg.tracker.spike_window, cfg.tracker.spike_threshold)
    state, uptime, run_id = resume.resume_job(job, backend, model, optimizer, data, spikes)  # new job: step 0
    track = tracking.start(
        cfg, run_dir, job, env, backend.name, n_params, state.step, run_id, uptime.state_dict(), data.run_info()
    )
    tracking.log_health(track, health, env, run_dir)
    hooks = build_hooks(
        cfg, backend, env, model, optimizer, data, spikes, uptime, track, job, run_dir, first_tokens=state.tokens_seen
    )

    trainer = Trainer(
        cfg, backend, dims, model, optimizer, data, spikes, uptime, track, hooks, job, run_dir, rank=env.rank
    )
    state = trainer.run(state)
    trainer.report(state)
    return RunResult(cfg, state, track.history, track.mlflow.run_id if track.mlflow else None)
