"""Torch elastic supervision: this process becomes the agent that starts, restarts and stops a job's processes.

The worker function the processes run is the caller's (``hlat.train.entry`` hands in the trainer); what a failure
means to the user (exit codes, "how to continue") is the caller's too. Imports ``hlat.config`` and the core only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, RunConfig
from hlat.config.resolvers import global_rank, under_elastic
from hlat.launch import preempt, rendezvous

log = logging.getLogger(__name__)

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job_logging format
Worker = Callable[[RunConfig, str, str], Any]
"""What each supervised process runs: ``worker(cfg, run_dir, log_file)``; it returns a picklable value."""


class JobFailedError(RuntimeError):
    """The supervised job ended without finishing; the message says why and how to continue."""


def wanted(cfg: RunConfig) -> bool:
    """Whether ``python train.py`` should start the trainer processes itself (and not just train in-process)."""
    c = cfg.cluster
    supervised = c.nproc_per_node > 1 or c.max_restarts > 0 or c.nodes > 1
    return supervised and not cfg.train.dry_run and not under_elastic()


def exit_code_text(exitcode: int) -> str:
    """A worker's exit code in words, when the caller knows no more about it."""
    return f"exit code {exitcode}"


def supervise(
    cfg: RunConfig, run_dir: Path, worker: Worker, explain_exit: Callable[[int], str] = exit_code_text
) -> dict[int, Any]:
    """Run ``cluster.nproc_per_node`` processes of ``worker`` under torch elastic, restarted up to ``max_restarts``.

    A signal to this process (the agent) is forwarded to the workers, which get ``train.preempt_grace_s`` + 10 s to
    stop with a checkpoint (:mod:`hlat.launch.preempt`) before they are killed.

    Returns:
        What each rank's ``worker`` returned, by global rank.

    Raises:
        ConfigError: The layout or the number of nodes cannot start from here (before any process starts).
        JobFailedError: The workers failed ``max_restarts + 1`` times (``explain_exit`` words the last exit code).
        PreemptedError: A signal stopped the workers and they wrote the checkpoint of the step in flight.
        AbortedError: A signal stopped the job before that checkpoint was complete.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    restarts = cfg.cluster.max_restarts
    config = _launch_config(cfg, run_dir, rendezvous.slurm_rendezvous())
    log.info(
        "starting %d trainer process(es) with torch elastic; up to %d restarts from the newest checkpoint",
        cfg.cluster.nproc_per_node,
        restarts,
    )
    try:
        return _run_agent(elastic_launch(config, worker), cfg, run_dir)
    except ChildFailedError as e:
        first = e.get_first_failure()[1]
        if first.exitcode == preempt.PREEMPTED_EXIT_CODE and (stopped := preempt.read_marker(run_dir)):
            raise stopped from None  # the trainers alone were signalled (restarts exhausted): they did checkpoint
        raise JobFailedError(
            f"the trainer failed {restarts + 1} times (cluster.max_restarts={restarts}); last failure: "
            f"{explain_exit(first.exitcode)}{', ' + _failure_text(first.message) if first.message else ''} "
            f"(details in {run_dir / 'elastic'}). "
            f"Rerun the same command with hydra.run.dir={run_dir} to continue from the newest checkpoint"
        ) from None


def _launch_config(cfg: RunConfig, run_dir: Path, slurm: tuple[str, str, int] | None) -> Any:
    """The ``LaunchConfig`` of this job, once its nodes and layout are checked (ConfigError)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from hlat.parallel import ParallelDims

    nodes = cfg.cluster.nodes
    _check_nodes(cfg, slurm)
    ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)  # before starting anything
    endpoint, run_id = ("localhost:0", f"hlat-{uuid.uuid4().hex[:8]}") if slurm is None else slurm[:2]
    # One node: its stores and sockets on 127.0.0.1 only (hlat.launch.rendezvous); several: c10d on the first host.
    rdzv = rendezvous.one_node_launch() if nodes == 1 else {"rdzv_backend": "c10d", "rdzv_endpoint": endpoint}
    return LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=cfg.cluster.nproc_per_node,
        run_id=run_id,
        **rdzv,
        max_restarts=cfg.cluster.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "elastic" / (f"node{global_rank()}" if slurm else ""))),
        **_stop_settings(LaunchConfig, cfg.train.preempt_grace_s),
    )


def _check_nodes(cfg: RunConfig, slurm: tuple[str, str, int] | None) -> None:
    """ConfigError unless this process can start every node of the job: one node, or each Slurm task its own."""
    nodes = cfg.cluster.nodes
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


def _stop_settings(launch_config: type, grace_s: float) -> dict[str, Any]:
    """``LaunchConfig`` fields that let a signalled agent stop its workers gracefully, where this torch has them.

    ``signals_to_handle`` adds Slurm's warning signals (USR1, USR2) to the ones forwarded to the workers, and
    ``shutdown_timeout`` waits :func:`hlat.launch.preempt.launcher_grace_s` instead of 30 s (older torch versions
    have neither field and forward SIGTERM, SIGINT, SIGHUP and SIGQUIT with 30 s).
    """
    wanted = {"signals_to_handle": preempt.AGENT_SIGNALS, "shutdown_timeout": preempt.launcher_grace_s(grace_s)}
    fields = {f.name for f in dataclasses.fields(launch_config)}
    return {k: v for k, v in wanted.items() if k in fields}


def _run_agent(launch: Any, cfg: RunConfig, run_dir: Path) -> dict[int, Any]:
    """Run the agent (``elastic_launch(config, worker)``); a signal to it becomes PreemptedError or AbortedError.

    torch elastic does not report how its workers ended after a signal, so rank 0's
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


def log_like_the_agent(log_file: str) -> None:
    """In a worker: log as Hydra does in the agent, to the console and to ``log_file``; only rank 0 below WARNING."""
    from hlat.logs import LibraryFilter

    console = logging.StreamHandler(sys.stdout)
    console.addFilter(LibraryFilter())  # mlflow's INFO lines to the file only, as under Hydra's job logging
    logging.basicConfig(
        level=logging.INFO, format=LOG_FORMAT, force=True, handlers=[console, logging.FileHandler(log_file)]
    )
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one rank narrates; the others speak up on problems
