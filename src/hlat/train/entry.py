"""``python train.py``'s entry: the config converted once, trained here, under torch elastic or as a multirun's job.

:func:`entry` turns every way a run can end into one message, an exit code and the command that continues it; the
build (``run.py``) only raises, and the supervision is :mod:`hlat.launch.elastic`'s. The one module that sees
Hydra's config and calls :func:`hlat.train.run.main`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from hlat import checkpoint
from hlat.checkpoint import CheckpointError
from hlat.config import ConfigError, RunConfig, to_run_config
from hlat.health.blame import last_verdict
from hlat.health.graph_guard import GRAPH_DIVERGENCE_EXIT_CODE, GraphDivergenceError, divergence_text
from hlat.health.host import check_neuron_host
from hlat.health.report import PreflightError
from hlat.health.watchdog import HANG_EXIT_CODE
from hlat.launch import elastic, preempt
from hlat.launch.elastic import JobFailedError
from hlat.state import HaltedError
from hlat.sweep import job as sweep_job
from hlat.track.mlflow_store import command_tracker
from hlat.train import evals
from hlat.train.evals import EvalFailedError
from hlat.train.run import main

log = logging.getLogger(__name__)

FINAL_ERRORS: tuple[type[Exception], ...] = (
    PreflightError,
    ConfigError,
    CheckpointError,
    HaltedError,
    EvalFailedError,
    GraphDivergenceError,
)
"""Failures a restart would only repeat: the worker reports them instead of dying, so the agent stops. (A node that
fails the pre-flight check fails it again after a restart onto the same nodes; a failed evaluation comes after the
last step; ranks that compiled different graphs compile them again.)"""


def hydra_output_dir() -> Path:
    """This Hydra job's output directory (``hydra.run.dir``, or the sweep job's directory)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _supervise(cfg: RunConfig, run_dir: Path) -> None:
    """Train under torch elastic (:func:`hlat.launch.elastic.supervise`); a final error of the trainers is raised here.

    Raises:
        ConfigError, CheckpointError, HaltedError, PreflightError, EvalFailedError: As the trainers raised them.
    """
    results = elastic.supervise(cfg, run_dir, _worker, functools.partial(_exit_text, run_dir=run_dir))
    for rank in sorted(results):  # every rank ends the same way; rank 0's words come first
        if results[rank] is not None:
            kind, message = results[rank]
            raise next(t for t in FINAL_ERRORS if t.__name__ == kind)(message)


def _exit_text(exitcode: int, run_dir: Path) -> str:
    """A worker's exit code, and what it means when hlat chose it (the hang watchdog's: its newest verdict)."""
    if exitcode == HANG_EXIT_CODE:
        hang = run_dir / "hang"
        verdict = last_verdict(hang)
        said = f": {verdict}" if verdict else ""
        return f"exit code {exitcode} (a hang{said}; the watchdog's report and stack dumps are in {hang})"
    if exitcode == GRAPH_DIVERGENCE_EXIT_CODE:
        said = divergence_text(run_dir) or "graph divergence"
        return f"exit code {exitcode} ({said}; each rank's graph ledger is in {run_dir / 'graphs'})"
    return elastic.exit_code_text(exitcode)


def _worker(cfg: RunConfig, run_dir: str, log_file: str) -> tuple[str, str] | None:
    """One (re)started trainer under torch elastic: log like the agent, train. Returns a final error, or None."""
    elastic.log_like_the_agent(log_file)
    # A restart is logged by hlat.launch.attempt once the ranks agree on it (this agent's own count can be 0 on a node
    # restarted because another node's worker died).
    try:  # a restart resumes this job's own progress (run.restart_resume)
        main(cfg, Path(run_dir))
    except FINAL_ERRORS as e:
        log.error("%s: %s", type(e).__name__, e)
        return type(e).__name__, str(e)
    except preempt.PreemptedError:
        # Exit at once: a returned value waits until the agent reads it, which a signalled agent never does.
        raise SystemExit(preempt.PREEMPTED_EXIT_CODE) from None
    except KeyboardInterrupt:  # a second Ctrl-C
        raise SystemExit(128 + signal.SIGINT) from None
    return None


# ---------------------------------------------------------------- the command line's entry, its errors and hints


def load_config(hydra_cfg: DictConfig) -> RunConfig:
    """Hydra's config, typed and validated (the one conversion), with the run's MLflow store settled and named.

    The store is ``tracker.uri`` given on the command line, else ``MLFLOW_TRACKING_URI``, else ``tracker.uri`` of
    the config files, else ``mlflow.db`` here (``hlat.track.mlflow_store.resolve_store``, as every hlat command).
    """
    from hydra.core.hydra_config import HydraConfig

    from hlat.config.resolvers import global_rank

    cfg = to_run_config(hydra_cfg)
    if cfg.tracker.kind != "mlflow" or cfg.train.dry_run:
        return cfg
    tracker, store = command_tracker(cfg.tracker, list(HydraConfig.get().overrides.task))
    if global_rank() == 0:
        log.info("%s", store.line("hlat"))
    return cfg if tracker is cfg.tracker else dataclasses.replace(cfg, tracker=tracker)


def _print_continue_hint(
    cfg: RunConfig, lead: str = "the run stopped", note: str = " (or set cluster.max_restarts to recover automatically)"
) -> None:
    """After a run stopped: the command that continues it from its newest checkpoint (if it has one)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc, run_dir = HydraConfig.get(), hydra_output_dir()
    root = checkpoint.checkpoint_root(cfg, run_dir)
    saved = checkpoint.newest_complete(root)  # never a damaged checkpoint: a rerun would skip it
    if saved is not None:
        # A single run continues in its own directory; a sweep job (its directory is Hydra's) by train.resume.
        keep = f"hydra.run.dir={run_dir}" if hc.mode != RunMode.MULTIRUN else f"train.resume={root}"
        overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.run.dir=", "train.resume="))]
        command = shlex.join(["python", "train.py", *overrides, keep])
        print(f"hlat: {lead}; to continue it from {saved.name}: {command}{note}", file=sys.stderr)


def _train(cfg: RunConfig) -> tuple[str | None, list[float]]:
    """Train in this process, or under torch elastic when the cluster asks for it.

    Returns:
        The MLflow run id (None without MLflow) and the loss points this process logged (none when supervised).
    """
    evals.check(cfg)  # the evaluation's tasks, before any process is started or anything built (every rank alike)
    if not cfg.train.dry_run:  # the Neuron packages, devices and limits: seconds, not after 32 processes started
        check_neuron_host(cfg.cluster)
    run_dir = hydra_output_dir()
    if elastic.wanted(cfg):
        _supervise(cfg, run_dir)
        return checkpoint.read_job(checkpoint.checkpoint_root(cfg, run_dir)).get("mlflow_run_id"), []
    try:
        result = main(cfg, run_dir)
    except (ConfigError, HaltedError, CheckpointError, EvalFailedError, GraphDivergenceError):
        raise
    except (preempt.PreemptedError, KeyboardInterrupt):
        raise
    except BaseException:  # a crash: say how to pick the run up again
        _print_continue_hint(cfg)
        raise
    return result.mlflow_run_id, [v for _, v in result.history.series("train/loss")]


def error_message(e: BaseException) -> str | None:
    """The one-line report of a failure the user can act on (config, halt, checkpoint, restarts); None otherwise."""
    if isinstance(e, PreflightError):
        return f"hlat: health check failed: {e}"
    if isinstance(e, ConfigError):
        return f"hlat: configuration error: {e}"
    if isinstance(e, (JobFailedError, HaltedError, checkpoint.CheckpointError, EvalFailedError, GraphDivergenceError)):
        return f"hlat: {e}"
    return None


def entry(hydra_cfg: DictConfig) -> float | None:
    """Command-line entry: train, under torch elastic when ``cluster.max_restarts > 0`` or several processes.

    A configuration error prints one clean message and exits 2 (a failed pre-flight health check: 3, a graph
    divergence between ranks: 76, their own ``exit_code``); a failure a rerun can continue from (a halt, a full
    disk, restarts exhausted) prints what happened and how to continue, and exits 1. A run stopped by a signal
    with a checkpoint of the step in flight (``hlat.launch.preempt``) prints the command that continues it and exits
    85; one stopped without it (a second Ctrl-C) exits 128 + the signal. A job of a multirun (``-m``) goes through
    :func:`hlat.sweep.job.run_job` instead, which returns the job's objective (and exits only when the job was
    stopped by a signal).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    load_cfg = functools.partial(load_config, hydra_cfg)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep_job.run_job(load_cfg, hydra_output_dir(), _train, error_message)
    cfg = None
    try:
        cfg = load_cfg()
        _train(cfg)
    except (preempt.PreemptedError, preempt.AbortedError, KeyboardInterrupt) as e:
        _stopped(cfg, e)
    except (ConfigError, HaltedError, checkpoint.CheckpointError, EvalFailedError, GraphDivergenceError) as e:
        print(error_message(e), file=sys.stderr)
        if cfg is not None and not isinstance(e, (ConfigError, EvalFailedError)):  # training did not finish
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
