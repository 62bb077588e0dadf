"""The Slurm batch script of a multi-node run (``hlat launch --target slurm``, ``hlat compile --target slurm``).

One ``srun`` task per node runs that node's torch elastic agent (:mod:`hlat.deploy.render`); a run's script also
requeues itself after a checkpoint on Slurm's time-limit signal. Imports ``hlat.config``, ``hlat.deploy.render`` and
``hlat.launch.preempt``.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence

from hlat.config import ClusterConfig, RunConfig
from hlat.deploy.render import (
    RDZV_PORT,
    ULIMIT,
    Install,
    command_text,
    export_lines,
    fresh_compile_dir,
    launch_env,
    purpose_lines,
    run_dir_of,
)
from hlat.launch.preempt import MARKER, launcher_grace_s

INSTANCE_VCPUS = {"trn1.32xlarge": 128, "trn1n.32xlarge": 128, "trn1.2xlarge": 8}
"""vCPUs of the instance types the cluster presets name (``#SBATCH --cpus-per-task``)."""


def default_cpus(cluster: ClusterConfig) -> int | None:
    """The vCPUs of one node from ``cluster.instance_type``, or None when the type is not in :data:`INSTANCE_VCPUS`."""
    return INSTANCE_VCPUS.get(cluster.instance_type or "")


def sbatch_script(
    cfg: RunConfig,
    overrides: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    install: Install,
    cpus_per_task: int | None,
    port: int = RDZV_PORT,
    compile_steps: int | None = None,
) -> str:
    """A Slurm batch script for the whole job: one task per node (``srun``), each running the node's torchrun.

    The first host of the allocation hosts the rendezvous. The agents get all of their node's CPUs
    (``--cpus-per-task``, given to ``srun`` too: since Slurm 22.05 a step no longer inherits the batch job's), so
    Slurm's CPU binding does not squeeze 32 trainer processes onto one core. The job enters ``install.root``
    itself, so it can be submitted from anywhere, by any shell; its output file lands where it was submitted.

    A run (not a compile) checkpoints and requeues itself near its time limit (:func:`_requeue_lines`).

    Args:
        cfg: The validated run config.
        overrides: The Hydra overrides ``train.py`` gets, ``hydra.run.dir`` included
            (:func:`hlat.deploy.render.train_overrides`).
        env: Variables to export (``srun`` passes them to every node).
        name: Slurm job name and rendezvous id.
        install: hlat's interpreter and checkout on the nodes.
        cpus_per_task: CPUs of one node (``cluster.cpus_per_task``, :func:`default_cpus`); None: every CPU that
            Slurm allocates on the node (``$SLURM_CPUS_ON_NODE`` of the ``--exclusive`` job).
        port: Rendezvous port on the first node.
        compile_steps: Render the ahead-of-time compile of this many steps instead of the run.
    """
    job = f"{name}-compile" if compile_steps is not None else name
    preemptible = compile_steps is None
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {s}" for s in _sbatch_options(cfg, job, cpus_per_task, preemptible)),
        f"# Rendered by hlat; submit it from anywhere: sbatch {job}.sbatch (it runs in {install.root})",
        *purpose_lines(cfg, compile_steps),
        *(["# Near its time limit the job checkpoints the step in flight and requeues itself."] if preemptible else []),
        "set -euo pipefail",
        "",
    ]
    if cfg.cluster.nodes > 1:  # the first host of the allocation hosts the rendezvous
        lines += ['MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "export MASTER_ADDR"]
    lines += [*install.setup_lines(), *export_lines(launch_env(cfg, env)), ULIMIT]
    if compile_steps is not None:
        lines.append(fresh_compile_dir(cfg, overrides, compile_steps))
    cpus = str(cpus_per_task) if cpus_per_task is not None else '"$SLURM_CPUS_ON_NODE"'
    command = command_text(cfg, overrides, name, port, compile_steps, install)
    srun = f"srun --kill-on-bad-exit=1 --cpus-per-task={cpus} {command}"
    if not preemptible:
        return "\n".join([*lines, "", srun]) + "\n"
    return "\n".join([*lines, *_requeue_lines(overrides, srun)]) + "\n"


def _sbatch_options(cfg: RunConfig, job: str, cpus_per_task: int | None, preemptible: bool) -> list[str]:
    """The ``#SBATCH`` options: one exclusive node per ``cluster.nodes``, one task each, and the time-limit signal."""
    c = cfg.cluster
    sbatch = [f"--job-name={job}", f"--nodes={c.nodes}", "--ntasks-per-node=1"]
    if cpus_per_task is not None:
        sbatch.append(f"--cpus-per-task={cpus_per_task}")
    if c.device == "cuda" and c.backend == "torch":
        sbatch.append(f"--gpus-per-node={c.devices_per_node}")
    sbatch += ["--exclusive", "--output=%x-%j.out"]
    if preemptible:  # the requeued job appends to the same output file
        sbatch += [f"--signal=USR1@{launcher_grace_s(cfg.train.preempt_grace_s)}", "--requeue", "--open-mode=append"]
    return sbatch


def _requeue_lines(overrides: Sequence[str], srun: str) -> list[str]:
    """``srun`` between removing a stale preemption marker and requeueing the job when the trainers left a new one.

    Slurm sends SIGUSR1 ``train.preempt_grace_s`` + 10 s before the time limit to the job steps: torchrun forwards
    it, the trainers checkpoint the step in flight and rank 0 leaves ``<run dir>/preempted.json``. torchrun's exit
    status does not say that (it exits 1 after a signal), so the script requeues the job when that marker is there,
    and the requeued job continues into the same run directory and MLflow run (``train.resume=auto``). ``scancel``
    signals the batch shell too, so a cancelled job is not requeued.

    Raises:
        ValueError: overrides without ``hydra.run.dir`` (where the marker is).
    """
    run_dir = run_dir_of(overrides)
    if run_dir is None:
        raise ValueError("sbatch_script needs the run's hydra.run.dir (see train_overrides)")
    marker = shlex.quote(posixpath.join(run_dir, MARKER))
    return [
        f"rm -f -- {marker}",
        "",
        "status=0",
        f"{srun} || status=$?",
        f"if [ -e {marker} ]; then  # the trainers stopped on a signal with a checkpoint: continue in a new allocation",
        '  echo "hlat: preempted with a checkpoint; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
