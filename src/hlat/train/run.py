"""Build everything from the composed config, then fit. The only module that sees Hydra/OmegaConf."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from hlat.backends import get_backend
from hlat.config import ConfigError, RunConfig, to_run_config
from hlat.data import build_loader
from hlat.eval.run import EvalScheduler
from hlat.health.monitors import Monitors
from hlat.health.preflight import log_preflight, preflight
from hlat.model import Transformer
from hlat.optim import lr_at, param_groups
from hlat.parallel import ParallelDims
from hlat.plan.memory import check_fits, check_world, estimate_memory, summary, summary_text
from hlat.sizing import bytes_per_param, flops_per_token
from hlat.track import sweep
from hlat.track.metrics import MetricsLogger, SpikeDetector, Throughput, first_peak_hint, resolve_peak_flops
from hlat.track.progress import ProgressBar
from hlat.track.provenance import write_provenance
from hlat.track.trackers import History, SeriesRecorder, build_tracker, check_reachable
from hlat.train import attempt, checkpoint, preempt
from hlat.train.faults import FaultInjector
from hlat.train.loop import NULL_TIMER, HaltedError, NonFiniteError, StepTimer, TrainState, fit, timed_hook
from hlat.train.resume import job_record, record_start, restore, rollback

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished (or dry) run returns to its caller."""

    config: RunConfig
    state: TrainState | None
    history: History
    mlflow_run_id: str | None


PLOTTED = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr", "spike/active")


def _start_tracking(cfg: RunConfig, hydra_cfg: DictConfig, run_dir: Path, tags: dict[str, str], rank: int,
                    extra: list, derived: dict[str, Any], run_id: str | None) -> tuple:  # fmt: skip
    """Write provenance into ``run_dir``, open the tracker, log params (config + ``derived``) and provenance files.

    Rank 0 alone writes the files (every rank of a job shares ``run_dir``) and alone tracks to MLflow.
    """
    prov_tags, files = write_provenance(run_dir, OmegaConf.to_yaml(hydra_cfg, resolve=True)) if rank == 0 else ({}, [])
    run_name = cfg.tracker.run_name or f"{cfg.model.name}-{cfg.precision.name}"
    tracker, mlflow_tracker = build_tracker(
        cfg.tracker, rank=rank, run_name=run_name, tags={**prov_tags, **tags}, extra=extra, run_id=run_id
    )
    params = checkpoint.flatten(OmegaConf.to_container(hydra_cfg, resolve=True))
    tracker.log_params(params | bytes_per_param(cfg.precision).as_params() | derived)
    for f in files:
        tracker.log_artifact(f)
    return tracker, mlflow_tracker


def checkpoint_root(cfg: RunConfig, run_dir: Path) -> Path:
    """Where the run's checkpoints go: ``train.checkpoint_dir``, or ``<run dir>/checkpoints``."""
    d = cfg.train.checkpoint_dir
    return Path(d).expanduser() if d else run_dir / "checkpoints"


def main(hydra_cfg: DictConfig, run_dir: Path | None = None) -> RunResult:
    """Train as ``hydra_cfg`` says; ``run_dir`` defaults to Hydra's output directory."""
    launched = time.time()  # the job's start, unless a checkpoint says it started earlier
    cfg = to_run_config(hydra_cfg)
    t = cfg.train
    history = History()
    if t.dry_run:  # planned for the cluster's world, without touching a device: runs anywhere (`hlat summary`)
        print(summary_text(cfg))
        return RunResult(cfg, None, history, None)
    attempt.current(timeout_s=cfg.health.collective_timeout_s)  # every rank agrees which restart this is, first
    record_start(checkpoint_root(cfg, run_dir or hydra_output_dir()), t.resume, launched)  # before all that can fail
    backend = get_backend(cfg.cluster.backend, cfg)
    env = backend.setup(cfg.cluster, cfg.precision, t.seed)
    check_world(cfg.cluster, env.world_size)
    dims = ParallelDims.build(cfg.parallelism, env.world_size, cfg.model, t)
    n_params, est = estimate_memory(cfg, dims)
    matmuls = f"{env.bf16_matmul} ({env.bf16_matmul_reason})" if env.bf16_matmul else None
    log.info("%s", summary(cfg, dims, n_params, est, env.memory_budget_bytes, matmuls))
    check_fits(est, env.memory_budget_bytes, cfg, dims=dims)  # before any allocation
    if cfg.model.mask_leak:
        log.warning("model.mask_leak=%d: attention sees %d future token(s); this run demonstrates the information "
                    "leak and its loss means nothing", cfg.model.mask_leak, cfg.model.mask_leak)  # fmt: skip
    run_dir = run_dir or hydra_output_dir()
    root = checkpoint_root(cfg, run_dir)
    config = dataclasses.asdict(cfg)
    resume = checkpoint.restart_resume(t.resume, root)
    resume_from = checkpoint.find_resume(resume, root)
    if resume_from is not None:
        checkpoint.check_compatible(resume_from, config)  # before anything is built, or any directory made
    checkpoint.check_disk_space(root, checkpoint.checkpoint_bytes(resume_from) or est.params + est.optimizer)
    record_start(root, t.resume, launched, create=True)  # a new job: after the read-only checks made no directory
    check_reachable(cfg.tracker, rank=env.rank)  # a dead tracker.uri fails now, not after building everything
    # Measure the devices and links before anything is built; a bad node fails every rank alike (PreflightError).
    health = preflight(cfg, env, out_dir=run_dir / "health", sync=backend.synchronize)
    # One trainer per checkpoint directory. Taken after the read-only checks above, which a live trainer's
    # directory cannot fool: if another trainer holds it, this raises before anything is built.
    lock = checkpoint.hold_lock(root) if env.rank == 0 else None

    data = build_loader(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
        seed=t.seed, dp_rank=dims.dp_rank(env.rank), dp_size=dims.dp,
    )  # fmt: skip
    init_state = _init_weights(cfg) if resume_from is None and t.init_from else None
    model = backend.build_model(functools.partial(Transformer, cfg.model), dims, cfg.parallelism, init_state)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer), cfg.optimizer)
    spikes = SpikeDetector(cfg.tracker.spike_window, cfg.tracker.spike_threshold)
    state, job = restore(backend, resume_from, model, optimizer, data, spikes) if resume_from else (TrainState(), {})
    uptime, job_run_id = job_record(job, checkpoint.read_job(root) if resume != "never" else {}, launched)

    progress = ProgressBar(t.steps, state.step, every=t.progress_every or t.log_every) if env.rank == 0 else None
    tags = {
        "backend": backend.name,
        "precision.bf16_matmul": env.bf16_matmul or "n/a",  # the policy that ran; n/a: no bf16 matmuls
        "run_dir": str(run_dir),
        "checkpoint_dir": str(root),
        sweep.HASH_TAG: sweep.config_hash(config),
        **sweep.parent_tags(run_dir, cfg.tracker.experiment),
    }
    if resume_from is not None:
        tags["resumed_from"] = str(resume_from)
    elif t.init_from:
        tags["init_from"] = str(t.init_from)
    recorder = SeriesRecorder(PLOTTED)
    extra_trackers = [history, recorder] + ([progress] if progress else [])
    throughput, peak_source = _throughput(cfg, n_params, env.world_size, env.bf16_matmul)
    tags["perf.peak_source"] = peak_source
    derived = {"perf.flops_per_token": throughput.flops_per_token,
               "perf.flops_per_token_causal": throughput.flops_per_token_causal,
               "perf.peak_tflops": throughput.peak_flops / 1e12 if throughput.peak_flops else None}  # fmt: skip
    tracker, mlflow_tracker = _start_tracking(cfg, hydra_cfg, run_dir, tags, env.rank, extra_trackers, derived,
                                              job_run_id)  # fmt: skip
    run_id = mlflow_tracker.run_id if mlflow_tracker else job_run_id
    if env.rank == 0:
        checkpoint.write_job(root, {"mlflow_run_id": run_id, "uptime": uptime.state_dict()})
        preempt.unmark(run_dir, mlflow_tracker)  # a preempted run that continues is no longer waiting to resume
    if throughput.peak_flops is None and env.rank == 0 and first_peak_hint(peak_source, cfg.data.cache_dir):
        log.info("no MFU metric: %s (said once per host; the run's tag perf.peak_source keeps it)", peak_source)
    if health is not None and env.rank == 0:
        log_preflight(health, tracker, run_dir / "health" / "preflight.md")

    tokens_per_step = t.global_batch_size * t.seq_len
    timer = StepTimer(backend.synchronize) if t.step_breakdown else NULL_TIMER
    logger = MetricsLogger(
        backend, model, tracker.log_metrics, every=t.log_every, last_step=t.steps, tokens_per_step=tokens_per_step,
        seq_len=t.seq_len, extra=lambda: {**data.stats(), **backend.host_metrics()}, spikes=spikes,
        spike_summary_every=cfg.tracker.spike_summary_every, throughput=throughput, uptime=uptime,
        layer_norms_every=cfg.tracker.layer_grad_norms_every, timer=timer,
    )  # fmt: skip

    def guard(s: TrainState, out: Any = None) -> None:
        """halt/rollback: act on a non-finite step the logger has fetched (every log interval, before every save)."""
        if t.on_nonfinite != "skip_step" and logger.first_nonfinite is not None:
            raise NonFiniteError(logger.first_nonfinite)

    def checkpoint_extra(s: TrainState) -> dict:
        logger.flush(s)  # the spike statistics and productive time in the checkpoint then cover every step up to it
        guard(s)  # never checkpoint a non-finite state
        if mlflow_tracker is not None:  # the metrics up to this step reach MLflow before the checkpoint is complete:
            mlflow_tracker.sync()  # a restart from it replays only later steps, so none is missing from the curve
        record = {"mlflow_run_id": run_id, "uptime": uptime.state_dict()}  # a restart continues this MLflow run
        return {"train_state": dataclasses.asdict(s), "data": data.state_dict(), "rng": torch.get_rng_state(),
                "spikes": spikes.state_dict(), "job": record}  # fmt: skip

    faults = FaultInjector(cfg.fault, t.steps, root / "faults", env.rank) if cfg.fault.active else None
    evals = _eval_scheduler(cfg, tokens_per_step, state.tokens_seen) if env.rank == 0 else None
    saver = checkpoint.Checkpointer(
        backend, root, model, optimizer, checkpoint_extra, every=t.checkpoint_every, last_step=t.steps,
        keep_last=t.keep_last, keep_every=t.keep_every,
        meta={"config": config, "config_hash": checkpoint.config_hash(config)},
        async_save=t.async_checkpoint, fault=faults.on_save if faults else None, rank=env.rank, on_saved=evals,
    )  # fmt: skip
    monitors = Monitors(cfg, env, model, run_dir, tracker.log_metrics)
    flag = preempt.SignalFlag()
    stop = preempt.StopHook(flag, t.steps, distributed=env.world_size > 1)  # collective, like Monitors
    hooks = [progress, timed_hook(timer, "logging", logger), guard, timed_hook(timer, "checkpoint", saver),
             *monitors.hooks, faults, stop]  # fmt: skip
    train = functools.partial(
        fit, model=model, optimizer=optimizer, data=iter(data), backend=backend,
        steps=t.steps, grad_accum=dims.grad_accum(t), clip_grad_norm=cfg.optimizer.clip_grad_norm,
        tokens_per_step=tokens_per_step, lr_fn=functools.partial(lr_at, cfg=cfg.optimizer, total_steps=t.steps),
        hooks=[h for h in hooks if h is not None],
        grad_hooks=([logger.capture_grads] if cfg.tracker.layer_grad_norms_every else [])
        + ([faults.poison_grads] if faults else []),
        skip_nonfinite=t.on_nonfinite == "skip_step", timer=timer,
    )  # fmt: skip
    status, stopped = "FAILED", None
    with flag:  # SIGTERM, SIGINT, SIGUSR1/2 stop training at the next step boundary, with a checkpoint of it
        try:
            monitors.start()
            logger.start(psutil.Process().create_time())
            while True:
                try:
                    state = train(state)
                    break
                except NonFiniteError as e:
                    state = rollback(e, state, t.on_nonfinite, saver, root, logger, uptime,
                                     functools.partial(restore, backend, model=model, optimizer=optimizer, data=data,
                                                       spikes=spikes))  # fmt: skip
                    if progress is not None:
                        progress.reset()
            saver.close()
            status = "FINISHED"
            if env.rank == 0 and cfg.tracker.plots:
                _plot(recorder, spikes, run_dir / "plots", tracker)
        except preempt.PreemptedError as e:
            status = "KILLED"
            monitors.close()  # the hang watchdog must not time the save
            stopped = preempt.checkpoint_now(e, saver, state, t.preempt_grace_s)
            if env.rank == 0:
                preempt.record(stopped, run_dir, mlflow_tracker)
            stop.barrier()  # no rank exits before rank 0 has completed the checkpoint (a launcher may then kill all)
        except KeyboardInterrupt:  # a second Ctrl-C: abort without the checkpoint
            status = "KILLED"
            raise
        finally:
            monitors.close()
            stop.close()
            if status != "FINISHED":
                try:  # let a save in flight complete: it is the state a restart resumes from
                    saver.close()
                except Exception:
                    log.exception("the checkpoint in flight failed as well")
            data.close()
            tracker.finish(status)
            if lock is not None:
                lock.close()
            if evals is not None:
                evals.close()  # the evaluations along training log into this run: let them finish
    if stopped is not None:
        preempt.report(stopped, t.preempt_grace_s)
        raise stopped
    if env.rank == 0:
        losses = history.series("train/loss") or [(0, float("nan"))]
        print(f"trained {state.step} steps, {state.tokens_seen:,} tokens: "
              f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")  # fmt: skip
        if saver.last_saved is not None:
            print(f"checkpoint: {saver.last_saved}")
        if mlflow_tracker is not None:
            print(mlflow_tracker.ui_hint())
    return RunResult(cfg, state, history, mlflow_tracker.run_id if mlflow_tracker else None)


def _init_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The weights of ``train.init_from``, checked against the model config and the run's tokenizer."""
    from hlat.eval.hf import load_init_weights

    state, tokenizer = load_init_weights(Path(cfg.train.init_from), cfg.model)
    mine = cfg.data.tokenizer
    if tokenizer is not None and (mine is None or Path(mine).expanduser().read_bytes() != tokenizer.read_bytes()):
        raise ConfigError(
            f"train.init_from={cfg.train.init_from} was trained with the tokenizer {tokenizer}, but this run "
            f"{'would train its own' if mine is None else f'uses data.tokenizer={mine}'}: set "
            f"data.tokenizer={tokenizer} so the token ids mean what the weights learned"
        )
    log.info("starting from the weights of %s", cfg.train.init_from)
    return state


def _eval_scheduler(cfg: RunConfig, tokens_per_step: int, tokens_seen: int) -> EvalScheduler | None:
    """The hook that evaluates checkpoints along training (``eval.every_tokens``), or None when that is off."""
    e = cfg.eval
    if not e.every_tokens:
        return None
    from hlat.eval.run import eval_overrides
    from hlat.track.trackers import default_uri

    if e.every_tokens < tokens_per_step * cfg.train.checkpoint_every:
        log.warning("eval.every_tokens=%d is below one checkpoint interval (%d tokens): evaluations happen at "
                    "checkpoints only", e.every_tokens, tokens_per_step * cfg.train.checkpoint_every)  # fmt: skip
    tracker = (
        ["tracker=console"]
        if cfg.tracker.kind != "mlflow"
        else [f"tracker.uri={cfg.tracker.uri or default_uri()}", f"tracker.experiment={cfg.tracker.experiment}"]
    )
    overrides = [*eval_overrides(e), *tracker]  # every eval field: command-line changes to the preset reach the child
    first = (tokens_seen // e.every_tokens + 1) * e.every_tokens  # a resumed run evaluates from where it is
    return EvalScheduler(e, tokens_per_step, overrides, next_tokens=first)


def _throughput(cfg: RunConfig, n_params: int, world_size: int, bf16_matmul: str | None) -> tuple[Throughput, str]:
    """FLOPs per token of this model and sequence length, the run's peak FLOP/s and cost per hour."""
    m = cfg.model
    per_token = functools.partial(flops_per_token, n_params, m.vocab_size * m.dim, m.n_layers, m.n_heads,
                                  m.head_dim, cfg.train.seq_len)  # fmt: skip
    peak, source = resolve_peak_flops(cfg.cluster, cfg.precision.compute_dtype, cfg.data.cache_dir, bf16_matmul)
    nodes = -(-world_size // cfg.cluster.devices_per_node)
    price = cfg.cluster.price_per_hour
    return Throughput(
        flops_per_token=per_token(causal=False),
        flops_per_token_causal=per_token(causal=True),
        peak_flops=peak * world_size if peak else None,
        cost_per_hour=price * nodes if price is not None else None,
    ), source


def _plot(recorder: SeriesRecorder, spikes: SpikeDetector, out_dir: Path, tracker) -> None:
    """End-of-run plots as artifacts; a plotting failure is logged, never fails a finished run."""
    from hlat.track.plots import training_plots

    try:
        for f in training_plots({k: recorder.series(k) for k in PLOTTED}, spikes.histogram(), out_dir):
            tracker.log_artifact(f)
    except Exception:  # the run itself succeeded; losing a plot must not change that
        log.exception("could not write the end-of-run plots to %s", out_dir)


def hydra_output_dir() -> Path:
    """This Hydra job's output directory (``hydra.run.dir``, or the sweep job's directory)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _print_continue_hint(cfg: RunConfig, lead: str = "the run stopped",
                         note: str = " (or set cluster.max_restarts to recover automatically)") -> None:  # fmt: skip
    """After a run stopped: the command that continues it from its newest checkpoint (if it has one)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc, run_dir = HydraConfig.get(), hydra_output_dir()
    root = checkpoint_root(cfg, run_dir)
    saved = checkpoint.newest_complete(root)  # never a damaged checkpoint: a rerun would skip it
    if saved is not None:
        # A single run continues in its own directory; a sweep job (its directory is Hydra's) by train.resume.
        keep = f"hydra.run.dir={run_dir}" if hc.mode != RunMode.MULTIRUN else f"train.resume={root}"
        overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.run.dir=", "train.resume="))]
        command = shlex.join(["python", "train.py", *overrides, keep])
        print(f"hlat: {lead}; to continue it from {saved.name}: {command}{note}", file=sys.stderr)


def _train(hydra_cfg: DictConfig, cfg: RunConfig) -> tuple[str | None, list[float]]:
    """Train in this process, or under torch elastic when the cluster asks for it.

    Returns:
        The MLflow run id (None without MLflow) and the loss points this process logged (none when supervised).
    """
    from hlat.train.launch import supervise, wants_launcher

    if wants_launcher(cfg):
        run_dir = hydra_output_dir()
        supervise(hydra_cfg, cfg, run_dir)
        return checkpoint.read_job(checkpoint_root(cfg, run_dir)).get("mlflow_run_id"), []
    try:
        result = main(hydra_cfg)
    except (ConfigError, HaltedError, checkpoint.CheckpointError, preempt.PreemptedError, KeyboardInterrupt):
        raise
    except BaseException:  # a crash: say how to pick the run up again
        _print_continue_hint(cfg)
        raise
    return result.mlflow_run_id, [v for _, v in result.history.series("train/loss")]


def error_message(e: BaseException) -> str | None:
    """The one-line report of a failure the user can act on (config, halt, checkpoint, restarts); None otherwise."""
    from hlat.health.report import PreflightError
    from hlat.train.launch import JobFailedError

    if isinstance(e, PreflightError):
        return f"hlat: health check failed: {e}"
    if isinstance(e, ConfigError):
        return f"hlat: configuration error: {e}"
    if isinstance(e, (JobFailedError, HaltedError, checkpoint.CheckpointError)):
        return f"hlat: {e}"
    return None


def entry(hydra_cfg: DictConfig) -> float | None:
    """Command-line entry: train, under torch elastic when ``cluster.max_restarts > 0`` or several processes.

    A configuration error prints one clean message and exits 2 (a failed pre-flight health check: 3, its own
    ``exit_code``); a failure a rerun can continue from (a halt, a full disk, restarts exhausted) prints what
    happened and how to continue, and exits 1. A run stopped by a signal with a checkpoint of the step in flight
    (``hlat.train.preempt``) prints the command that continues it and exits 85; one stopped without it (a second Ctrl-C)
    exits 128 + the signal. A job of a multirun (``-m``) goes through :func:`hlat.track.sweep.run_job` instead, which
    returns the job's objective (and exits only when the job was stopped by a signal).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep.run_job(hydra_cfg, hydra_output_dir(), _train)
    cfg = None
    try:
        cfg = to_run_config(hydra_cfg)
        _train(hydra_cfg, cfg)
    except (preempt.PreemptedError, preempt.AbortedError, KeyboardInterrupt) as e:
        _stopped(cfg, e)
    except (ConfigError, HaltedError, checkpoint.CheckpointError) as e:
        print(error_message(e), file=sys.stderr)
        if cfg is not None and not isinstance(e, ConfigError):
            _print_continue_hint(cfg)
        raise SystemExit(getattr(e, "exit_code", 2 if isinstance(e, ConfigError) else 1)) from None
    except Exception as e:
        if (message := error_message(e)) is None:
            raise
        print(message, file=sys.stderr)
        raise SystemExit(1) from None
    return None


def _stopped(cfg: RunConfig | None, e: BaseException) -> NoReturn:
    """A run stopped by a signal: say what was saved and how to continue, then exit (85, or 128 + the signal)."""
    if isinstance(e, preempt.PreemptedError):
        print(f"hlat: {e}; the MLflow run is KILLED and tagged hlat.resumable=true", file=sys.stderr)
        if cfg is not None:
            _print_continue_hint(cfg, lead="the run was preempted", note="")
        preempt.hand_over(e.signum)  # under submitit: it requeues the job
        raise SystemExit(preempt.PREEMPTED_EXIT_CODE)
    interrupted = isinstance(e, preempt.AbortedError)
    why = str(e) if interrupted else "interrupted (Ctrl-C) before a checkpoint of the step in flight was written"
    print(f"hlat: {why}", file=sys.stderr)
    if cfg is not None:
        _print_continue_hint(cfg, lead="the run was interrupted", note="")
    raise SystemExit(128 + (e.signum if interrupted else signal.SIGINT))
