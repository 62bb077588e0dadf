"""Build everything from the composed config, then fit: the build graph, read top to bottom in :func:`main`.

config -> backend -> plan (layout, memory) -> job (resume, checks, lock) -> data -> model/optimizer -> state ->
tracking/monitors -> fit -> report. Each step is a named function or object of the package that owns it; what to
do when a step fails (exit codes, "how to continue" hints, restarts) is the launcher's (:mod:`hlat.train.launch`).
With :mod:`hlat.train.launch` and the sweep modules, the only code that sees Hydra/OmegaConf.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from hlat.backends import get_backend
from hlat.config import RunConfig, to_run_config
from hlat.data import build_loader
from hlat.health.preflight import preflight
from hlat.model import Transformer, warn_mask_leak
from hlat.optim import param_groups
from hlat.plan.memory import check_run, summary_text
from hlat.state import TrainState
from hlat.track.metrics import SpikeDetector
from hlat.track.trackers import History, check_reachable
from hlat.train import checkpoint, resume, tracking
from hlat.train.trainer import Trainer
from hlat.train.weights import initial_weights

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished (or dry) run returns to its caller."""

    config: RunConfig
    state: TrainState | None
    history: History
    mlflow_run_id: str | None


def main(hydra_cfg: DictConfig, run_dir: Path | None = None) -> RunResult:
    """Train as ``hydra_cfg`` says; ``run_dir`` defaults to Hydra's output directory."""
    launched = time.time()  # the job's start, unless a checkpoint says it started earlier
    cfg = to_run_config(hydra_cfg)
    t = cfg.train
    if t.dry_run:  # planned for the cluster's world, without touching a device: runs anywhere (`hlat summary`)
        print(summary_text(cfg))
        return RunResult(cfg, None, History(), None)
    run_dir = run_dir or hydra_output_dir()
    resume.begin(cfg, run_dir, launched)  # the ranks agree which restart this is; the start is counted
    backend = get_backend(cfg.cluster.backend, cfg)
    env = backend.setup(cfg.cluster, cfg.precision, t.seed)
    matmuls = f"{env.bf16_matmul} ({env.bf16_matmul_reason})" if env.bf16_matmul else None
    dims, n_params, est = check_run(cfg, env.world_size, env.memory_budget_bytes, matmuls)  # before any allocation
    warn_mask_leak(cfg.model)
    job = resume.open_job(cfg, run_dir, est.params + est.optimizer, launched)  # read-only checks, then the record
    check_reachable(cfg.tracker, rank=env.rank)  # a dead tracker.uri fails now, not after building everything
    # Measure the devices and links before anything is built; a bad node fails every rank alike (PreflightError).
    health = preflight(cfg, env, out_dir=run_dir / "health", sync=backend.synchronize)
    # One trainer per checkpoint directory: if another trainer holds it, this raises before anything is built.
    lock = checkpoint.hold_lock(job.root) if env.rank == 0 else None

    data = build_loader(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        seed=t.seed, dp_rank=dims.dp_rank(env.rank), dp_size=dims.dp,
    )  # fmt: skip
    init_state = initial_weights(cfg) if job.resume_from is None and t.init_from else None
    model = backend.build_model(functools.partial(Transformer, cfg.model), dims, cfg.parallelism, init_state)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer), cfg.optimizer)
    spikes = SpikeDetector(cfg.tracker.spike_window, cfg.tracker.spike_threshold)
    state, saved = (resume.restore(backend, job.resume_from, model, optimizer, data, spikes) if job.resume_from
                    else (TrainState(), {}))  # fmt: skip
    latest = checkpoint.read_job(job.root) if job.resume != "never" else {}
    uptime, saved_run_id = resume.job_record(saved, latest, launched)

    track = tracking.start(cfg, hydra_cfg, run_dir, job, env, backend.name, n_params, state.step, saved_run_id,
                           uptime.state_dict())  # fmt: skip
    tracking.log_health(track, health, env, run_dir)
    trainer = Trainer(cfg, backend, env, dims, model, optimizer, data, spikes, uptime, track, job, run_dir,
                      first_tokens=state.tokens_seen, lock=lock)  # fmt: skip
    state = trainer.run(state)
    trainer.report(state)
    return RunResult(cfg, state, track.history, track.mlflow.run_id if track.mlflow else None)


def hydra_output_dir() -> Path:
    """This Hydra job's output directory (``hydra.run.dir``, or the sweep job's directory)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
