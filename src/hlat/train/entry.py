"""The launcher: ``python train.py``'s entry, torch elastic supervision, and what a failure prints and exits with.

:func:`entry` (``train.py``, ``hlat train``) trains in this process (:func:`hlat.train.run.main`), under torch
elastic, or as one job of a multirun (:mod:`hlat.sweep.job`), and turns every way a run can end into one
message, an exit code and the command that continues it; the build itself (``run.py``) only raises.

Local processes and automatic fault recovery: with ``cluster.nproc_per_node > 1`` or ``cluster.max_restarts > 0`` the
launching process becomes a torch elastic agent (the engine behind ``torchrun``, through its ``elastic_launch``
API): it starts ``nproc_per_node`` trainer processes (the ranks) and, when one dies (SIGKILL, a hardware or
communication error, any exception), restarts the whole group, up to ``max_restarts`` times. Every restart reuses the
run directory, so ``train.resume=auto`` continues from the newest valid checkpoint and the same MLflow run. Errors that
a restart cannot fix (a configuration error, a halt on a non-finite step, a full disk) end the job at once instead.
Under an external ``torchrun`` (or Slurm / Kubeflow launching one) the trainer simply runs: that launcher already
supervises it. A signal to the agent (SIGTERM, Ctrl-C, Slurm's SIGUSR1/SIGUSR2) is forwarded to the trainers, which stop
at the next step boundary with a checkpoint of it (``hlat.launch.preempt``); the job then ends preempted and resumable,
not restarted.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shlex
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig

from hlat import checkpoint
from hlat.checkpoint import CheckpointError
from hlat.config import ConfigError, RunConfig, to_run_config
from hlat.config.resolvers import global_rank, under_elastic
from hlat.health.blame import last_verdict
from hlat.health.report import PreflightError
from hlat.health.watchdog import HANG_EXIT_CODE
from hlat.launch import preempt
from hlat.state import HaltedError
from hlat.sweep import job as sweep_job
from hlat.train import evals
from hlat.train.evals import EvalFailedError
from hlat.train.run import main

log = logging.getLogger(__name__)

FINAL_ERRORS: tuple[type[Exception], ...] = (PreflightError, ConfigError, CheckpointError, HaltedError, EvalFailedError)
"""Failures a restart would only repeat: the worker reports them instead of dying, so the agent stops. (A node that
fails the pre-flight check fails it again after a restart onto the same nodes; a failed evaluation comes after the
last step.)"""
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job_logging format


class JobFailedError(RuntimeError):
    """The supervised job ended without finishing; the message says why and how to continue."""


def slurm_rendezvous() -> tuple[str, str, int] | None:
    """Under Hydra's submitit Slurm launcher: ``(rendezvous endpoint, run id, nodes)`` of this Slurm job.

    ``hydra/launcher=slurm`` starts one task per node; each becomes a torch elastic agent (what ``torchrun`` is)
    for its node's trainers, and the agents meet at the job's first host, as NxD's Slurm scripts do with torchrun.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit

    job = submitit.JobEnvironment()
    return f"{job.hostnames[0]}:{RDZV_PORT}", f"slurm-{job.job_id}", job.num_nodes


RDZV_PORT = 29400
"""The c10d rendezvous port on a Slurm job's first host (torchrun's default)."""


def wants_launcher(cfg: RunConfig) -> bool:
    """Whether ``python train.py`` should start the trainer processes itself (and not just train in-process)."""
    c = cfg.cluster
    supervised = c.nproc_per_node > 1 or c.max_restarts > 0 or c.nodes > 1
    return supervised and not cfg.train.dry_run and not under_elastic()


def hydra_output_dir() -> Path:
    """This Hydra job's output directory (``hydra.run.dir``, or the sweep job's directory)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def supervise(cfg: RunConfig, run_dir: Path) -> None:
    """Run ``cluster.nproc_per_node`` trainer processes under torch elastic, restarted up to ``max_restarts`` times.

    A signal to this process (the agent) is forwarded to the trainers, which stop at the next step boundary with a
    checkpoint (``hlat.launch.preempt``); the agent waits ``train.preempt_grace_s`` + 10 s for them before it kills
    them.

    Raises:
        ConfigError, CheckpointError, HaltedError: As raised by the trainer (never retried).
        JobFailedError: The trainer failed ``max_restarts + 1`` times.
        PreemptedError: A signal stopped the trainers and they wrote the checkpoint of the step in flight.
        AbortedError: A signal stopped the job before that checkpoint was complete.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    restarts, nproc, nodes = cfg.cluster.max_restarts, cfg.cluster.nproc_per_node, cfg.cluster.nodes
    slurm = slurm_rendezvous()
    endpoint, run_id = ("localhost:0", f"hlat-{uuid.uuid4().hex[:8]}") if slurm is None else slurm[:2]
    if nodes > 1 and slurm is None:
        raise ConfigError(
            f"cluster={cfg.cluster.name} spans {nodes} nodes, but `python train.py` starts the processes "
            "of this node only; start every node with the launch `hlat launch --target torchrun|slurm|eks <same "
            "overrides>` renders, run it on Slurm with `-m hydra/launcher=slurm`, or use a one-node cluster "
            "(e.g. cluster=trn1_1node)"
        )
    if slurm is not None and slurm[2] != nodes:
        raise ConfigError(
            f"this Slurm job has {slurm[2]} node(s) but cluster={cfg.cluster.name} needs {nodes}; keep the launcher's "
            "hydra.launcher.nodes at ${cluster.nodes} (conf/hydra/launcher/slurm.yaml)"
        )
    from hlat.launch.rendezvous import one_node_launch
    from hlat.parallel import ParallelDims

    ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)  # before starting anything
    # One node: its stores and sockets on 127.0.0.1 only (hlat.launch.rendezvous); several: c10d on the first host.
    rdzv = one_node_launch() if nodes == 1 else {"rdzv_backend": "c10d", "rdzv_endpoint": endpoint}
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        **rdzv,
        max_restarts=restarts,
        monitor_interval=0.5,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "elastic" / (f"node{global_rank()}" if slurm else ""))),
        **_stop_settings(LaunchConfig, cfg.train.preempt_grace_s),
    )
    log.info(
        "starting %d trainer process(es) with torch elastic; up to %d restarts from the newest checkpoint",
        nproc,
        restarts,
    )
    try:
        results = _run_agent(elastic_launch(config, _worker), cfg, run_dir)
    except ChildFailedError as e:
        first = e.get_first_failure()[1]
        if first.exitcode == preempt.PREEMPTED_EXIT_CODE and (stopped := preempt.read_marker(run_dir)):
            raise stopped from None  # the trainers alone were signalled (restarts exhausted): they did checkpoint
        raise JobFailedError(
            f"the trainer failed {restarts + 1} times (cluster.max_restarts={restarts}); last failure: "
            f"{_exit_text(first.exitcode, run_dir)}{', ' + _failure_text(first.message) if first.message else ''} "
            f"(details in {run_dir / 'elastic'}). "
            f"Rerun the same command with hydra.run.dir={run_dir} to continue from the newest checkpoint"
        ) from None
    for rank in sorted(results):  # every rank ends the same way; rank 0's words come first
        if results[rank] is not None:
            kind, message = results[rank]
            raise next(t for t in FINAL_ERRORS if t.__name__ == kind)(message)


def _stop_settings(launch_config: type, grace_s: float) -> dict[str, Any]:
    """``LaunchConfig`` fields that let a signalled agent stop its trainers gracefully, where this torch has them.

    ``signals_to_handle`` adds Slurm's warning signals (USR1, USR2) to the ones the agent forwards to its workers,
    and ``shutdown_timeout`` waits ``grace_s`` + :data:`hlat.launch.preempt.MARGIN_S` for them instead of 30 s (older
    torch versions have neither field and forward SIGTERM, SIGINT, SIGHUP and SIGQUIT with 30 s).
    """
    wanted = {"signals_to_handle": preempt.AGENT_SIGNALS, "shutdown_timeout": preempt.launcher_grace_s(grace_s)}
    fields = {f.name for f in dataclasses.fields(launch_config)}
    return {k: v for k, v in wanted.items() if k in fields}


def _run_agent(launch: Any, cfg: RunConfig, run_dir: Path) -> dict[int, Any]:
    """Run the agent (``elastic_launch(config, _worker)``); a signal to it becomes PreemptedError or AbortedError.

    torch elastic turns the signal into ``SignalException`` after forwarding it to the workers and waiting for them
    (or killing them after its shutdown timeout); it does not report how they ended, so rank 0's
    :data:`hlat.launch.preempt.MARKER` says whether the checkpoint was completed. The agent's signal handlers are put
    back afterwards: torch elastic leaves its own installed.
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    preempt.clear_marker(run_dir)
    handled = [getattr(signal, name) for name in preempt.AGENT_SIGNALS.split(",")]
    saved = {s: signal.getsignal(s) for s in handled}
    try:
        return launch(cfg, str(run_dir), _log_file(run_dir))
    except SignalException as e:
        raise preempt.read_marker(run_dir) or preempt.AbortedError(e.sigval) from None
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _exit_text(exitcode: int, run_dir: Path) -> str:
    """A worker's exit code, and what it means when hlat chose it (the hang watchdog's: its newest verdict)."""
    if exitcode == HANG_EXIT_CODE:
        hang = run_dir / "hang"
        verdict = last_verdict(hang)
        said = f": {verdict}" if verdict else ""
        return f"exit code {exitcode} (a hang{said}; the watchdog's report and stack dumps are in {hang})"
    return f"exit code {exitcode}"


def _failure_text(message: object) -> str:
    """A torch elastic failure message: a string, or the error file's dict (``{"message": ..., "extraInfo": ...}``)."""
    if isinstance(message, dict):
        return str(message.get("message", message))
    return str(message)


def _log_file(run_dir: Path) -> str:
    """The file Hydra logs this job to (its FileHandler), so the workers append to the same one."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return h.baseFilename
    return str(run_dir / "train.log")


def _worker(cfg: RunConfig, run_dir: str, log_file: str) -> tuple[str, str] | None:
    """One (re)started trainer: log like Hydra does, train. Returns a final error, or None."""
    from hlat.logs import LibraryFilter

    console = logging.StreamHandler(sys.stdout)
    console.addFilter(LibraryFilter())  # mlflow's INFO lines to the file only, as under Hydra's job logging
    logging.basicConfig(
        level=logging.INFO, format=LOG_FORMAT, force=True, handlers=[console, logging.FileHandler(log_file)]
    )
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one rank narrates; the others speak up on problems
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
    run_dir = hydra_output_dir()
    if wants_launcher(cfg):
        supervise(cfg, run_dir)
        return checkpoint.read_job(checkpoint.checkpoint_root(cfg, run_dir)).get("mlflow_run_id"), []
    try:
        result = main(cfg, run_dir)
    except (ConfigError, HaltedError, CheckpointError, EvalFailedError, preempt.PreemptedError, KeyboardInterrupt):
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
    if isinstance(e, (JobFailedError, HaltedError, checkpoint.CheckpointError, EvalFailedError)):
        return f"hlat: {e}"
    return None


def entry(hydra_cfg: DictConfig) -> float | None:
    """Command-line entry: train, under torch elastic when ``cluster.max_restarts > 0`` or several processes.

    A configuration error prints one clean message and exits 2 (a failed pre-flight health check: 3, its own
    ``exit_code``); a failure a rerun can continue from (a halt, a full disk, restarts exhausted) prints what
    happened and how to continue, and exits 1. A run stopped by a signal with a checkpoint of the step in flight
    (``hlat.launch.preempt``) prints the command that continues it and exits 85; one stopped without it (a second
    Ctrl-C) exits 128 + the signal. A job of a multirun (``-m``) goes through :func:`hlat.sweep.job.run_job` instead,
    which returns the job's objective (and exits only when the job was stopped by a signal).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    load = functools.partial(to_run_config, hydra_cfg)  # Hydra's config, typed and validated: the one conversion
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep_job.run_job(load, hydra_output_dir(), _train, error_message)
    cfg = None
    try:
        cfg = load()
        _train(cfg)
    except (preempt.PreemptedError, preempt.AbortedError, KeyboardInterrupt) as e:
        _stopped(cfg, e)
    except (ConfigError, HaltedError, checkpoint.CheckpointError, EvalFailedError) as e:
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
