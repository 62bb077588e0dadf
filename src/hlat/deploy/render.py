"""The trainer's command line on one node and the shell scripts around it: a per-node script and a Slurm sbatch.

Each node runs one torch elastic agent, ``torchrun``, with ``cluster.nproc_per_node`` trainer processes. Nodes meet
in a c10d rendezvous hosted on the first node (``$MASTER_ADDR``), and ``--max-restarts`` is
``cluster.max_restarts``. This is the mechanism that ``hlat.launch`` uses for ``python train.py``, stretched over
``cluster.nodes`` hosts. Under an external torchrun, ``train.py`` trains in place (``hlat.launch.under_elastic``).

Every rank on every node, and every restart, has to write to one run directory: that is where ``train.resume=auto``
looks for the newest checkpoint. Hydra's default ``outputs/<date>/<time>`` differs from process to process, so the
launch pins ``hydra.run.dir`` (:func:`train_overrides`).

Preemption (``hlat.preempt``): torchrun forwards SIGTERM and Slurm's warning signal (``PET_SIGNALS_TO_HANDLE``) to
the trainers, which checkpoint the step in flight within ``train.preempt_grace_s``, and waits that plus 10 s for
them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; torch versions without it wait 30 s). The sbatch script asks Slurm for
SIGUSR1 that long before the time limit and requeues the job when the trainers leave the preemption marker.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence

from hlat.config import ClusterConfig, RunConfig
from hlat.parallel import ParallelDims
from hlat.preempt import AGENT_SIGNALS, MARKER, launcher_grace_s

RDZV_PORT = 29400
"""Port of the c10d rendezvous store on the first node (torchrun's default for c10d)."""
NOFILE = 65535
"""Open-file limit for the trainer processes (the Neuron scripts raise it; reference neuron-nxd.md §2.1)."""
ULIMIT = f'ulimit -n {NOFILE} || ulimit -n "$(ulimit -Hn)"'
"""Raise the open-file limit, or to the hard limit where that is lower (a failed ``ulimit`` must not end the job)."""
TRAIN_SCRIPT = "train.py"
COMPILE_WRAPPER = "neuron_parallel_compile"
"""Runs the command in graph-extraction mode and compiles every graph it saw into the Neuron cache, in parallel."""
COMPILE_SUBDIR = "compile"
"""The compile run's own directory under the run directory, so its checkpoints never reach the real run."""
HOST_ONLY_KEYS = (
    "train.steps",
    "optimizer.warmup_steps",
    "train.resume",
    "train.checkpoint_dir",
    "tracker.kind",
    "hydra.run.dir",
)
"""The only keys that :func:`compile_overrides` may change. None of them changes a traced graph: the learning rate is
a host-side float (``hlat.optim``), and the others are file and tracking settings."""
INSTANCE_VCPUS = {"trn1.32xlarge": 128, "trn1n.32xlarge": 128, "trn1.2xlarge": 8}
"""vCPUs of the instance types the cluster presets name (``#SBATCH --cpus-per-task``)."""
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ShellWord(str):
    """A word that goes into a shell script as written, because it expands a variable (``"$MASTER_ADDR:29400"``)."""


def override_key(override: str) -> str:
    """The config key that an override sets: ``train.steps=5`` gives ``train.steps``, ``+a.b=1`` gives ``a.b``."""
    return override.split("=", 1)[0].lstrip("+~")


def job_name(cfg: RunConfig, overrides: Sequence[str]) -> str:
    """The default job name: ``hlat-<model>-<cluster>-<6 hex digits of the overrides>``.

    The digest makes different configurations of one model on one cluster get different names, so they get
    different run directories and never resume from each other's checkpoints. The same command gives the same
    name, so rerunning it continues the job.
    """
    digest = hashlib.sha1("\0".join(sorted(overrides)).encode()).hexdigest()[:6]
    raw = f"hlat-{cfg.model.name}-{cfg.cluster.name}-{digest}".lower()
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw))


def check_name(name: str) -> None:
    """Refuse a job name that Slurm, Kubernetes (a DNS-1035 label) or a directory would mangle.

    Raises:
        ValueError: naming the rule.
    """
    if not _NAME.match(name) or len(name) > 63:
        raise ValueError(
            f"job name {name!r} must be 1-63 lower-case letters, digits and '-', starting with a letter and not "
            "ending with '-' (a Kubernetes DNS-1035 label)"
        )


def run_dir_of(overrides: Sequence[str]) -> str | None:
    """The ``hydra.run.dir`` that the overrides set (the last one wins, as in Hydra), or None."""
    dirs = [o.split("=", 1)[1] for o in overrides if override_key(o) == "hydra.run.dir" and "=" in o]
    return dirs[-1] if dirs else None


def train_overrides(overrides: Sequence[str], run_dir: str) -> list[str]:
    """The overrides ``train.py`` gets: the user's, plus ``hydra.run.dir=<run_dir>`` unless they set one."""
    if run_dir_of(overrides) is not None:
        return list(overrides)
    return [*overrides, f"hydra.run.dir={run_dir}"]


def compile_overrides(cfg: RunConfig, overrides: Sequence[str], steps: int) -> list[str]:
    """The run's overrides for an ahead-of-time compile of ``steps`` steps.

    The Neuron cache is keyed by the traced graphs and the compiler flags, so every setting that shapes a graph
    stays exactly as in the run (reference neuron-nxd.md §2.3: otherwise the cache misses). Only keys in
    :data:`HOST_ONLY_KEYS` change, and they are appended last:

    - ``train.steps=<steps>``;
    - ``optimizer.warmup_steps=<steps - 1>``, only when the warmup would not end inside the short run (the config
      refuses that);
    - ``train.resume=never``, ``train.checkpoint_dir=null`` (if set) and ``hydra.run.dir=<run dir>/compile``, so the
      compile run neither resumes a real checkpoint nor writes one the real run would resume. Graph extraction
      produces no real numbers;
    - ``tracker.kind=console``, so that no MLflow run fills up with those numbers.

    Args:
        cfg: The run's validated config.
        overrides: The run's overrides, ``hydra.run.dir`` included (:func:`train_overrides`).
        steps: Optimizer steps to trace (>= 1).
    """
    run_dir = run_dir_of(overrides)
    if run_dir is None:
        raise ValueError("compile_overrides needs the run's hydra.run.dir (see train_overrides)")
    changed = [f"train.steps={steps}"]
    if cfg.optimizer.warmup_steps >= steps:
        changed.append(f"optimizer.warmup_steps={steps - 1}")
    changed.append("train.resume=never")
    if cfg.train.checkpoint_dir is not None:
        changed.append("train.checkpoint_dir=null")
    if cfg.tracker.kind != "console":
        changed.append("tracker.kind=console")
    changed.append(f"hydra.run.dir={posixpath.join(run_dir, COMPILE_SUBDIR)}")
    assert {override_key(c) for c in changed} <= set(HOST_ONLY_KEYS)
    replaced = {override_key(c) for c in changed}
    return [o for o in overrides if override_key(o) not in replaced] + changed


def torchrun_argv(cfg: RunConfig, overrides: Sequence[str], *, endpoint: str, rdzv_id: str) -> list[str]:
    """``torchrun ... train.py <overrides>`` for one node of ``cfg.cluster``, as a list of words.

    One node uses ``--standalone`` (a private rendezvous). More nodes meet at ``endpoint`` (``host:port`` of the
    first node) under ``rdzv_id``.
    """
    c = cfg.cluster
    if c.nodes == 1:
        words = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(c.nproc_per_node)]
    else:
        words = [
            "--nnodes",
            str(c.nodes),
            "--nproc-per-node",
            str(c.nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            rdzv_id,
        ]
    return ["torchrun", *words, "--max-restarts", str(c.max_restarts), TRAIN_SCRIPT, *overrides]


def shell_join(words: Sequence[str]) -> str:
    """Quote each word for the shell (``shlex.quote``) except the :class:`ShellWord` ones."""
    return " ".join(w if isinstance(w, ShellWord) else shlex.quote(w) for w in words)


def torchrun_line(cfg: RunConfig, overrides: Sequence[str], *, rdzv_id: str, port: int = RDZV_PORT) -> str:
    """The per-node torchrun command as one shell line. It meets at ``$MASTER_ADDR:<port>``, the first node."""
    return shell_join(torchrun_argv(cfg, overrides, endpoint=ShellWord(f'"$MASTER_ADDR:{port}"'), rdzv_id=rdzv_id))


def launch_env(cfg: RunConfig, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus what every launch exports on its backend.

    On neuron this adds ``NEURON_COMPILE_CACHE_URL=cluster.compile_cache`` unless ``env`` sets it, so the run reads
    the cache that ``hlat compile`` filled. Everywhere it tells torchrun to forward Slurm's warning signals too
    (``PET_SIGNALS_TO_HANDLE``, torchrun's ``--signals-to-handle``) and to give the signalled trainers
    ``train.preempt_grace_s`` + 10 s before it kills them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``); environment
    variables, because a torchrun that predates these settings ignores them where it would refuse the flags.

    Raises:
        ValueError: a name that is not a shell variable name.
    """
    out = {k: str(v) for k, v in env.items()}
    if cfg.cluster.backend == "neuron":
        out.setdefault("NEURON_COMPILE_CACHE_URL", cfg.cluster.compile_cache)
    out.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    out.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(launcher_grace_s(cfg.train.preempt_grace_s)))
    bad = [k for k in out if not _ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"environment variable names {bad} are not valid shell names")
    return out


def layout(cfg: RunConfig) -> str:
    """One line about the job: nodes, ranks, parallel degrees, restarts. Raises ConfigError for a bad layout."""
    c = cfg.cluster
    dims = ParallelDims.build(cfg.parallelism, c.world_size, cfg.model, cfg.train)
    restarts = f"restarts up to {c.max_restarts} times from the newest checkpoint" if c.max_restarts else "no restarts"
    nodes = f"{c.nodes} nodes" if c.nodes > 1 else "1 node"
    return (
        f"{nodes} x {c.nproc_per_node} processes = {c.world_size} ranks (tp {dims.tp}, pp {dims.pp}, dp {dims.dp}); "
        f"torch elastic, {restarts}"
    )


def _command(cfg: RunConfig, overrides: Sequence[str], name: str, port: int, compile_steps: int | None) -> str:
    """The torchrun command (wrapped in neuron_parallel_compile for a compile), broken before ``train.py``."""
    endpoint = ShellWord(f'"$MASTER_ADDR:{port}"')
    if compile_steps is not None:
        overrides = compile_overrides(cfg, overrides, compile_steps)
    words = torchrun_argv(cfg, overrides, endpoint=endpoint, rdzv_id=name)
    if compile_steps is not None:
        words = [COMPILE_WRAPPER, *words]
    cut = words.index(TRAIN_SCRIPT)
    return f"{shell_join(words[:cut])} \\\n  {shell_join(words[cut:])}"


def _fresh_compile_dir(cfg: RunConfig, overrides: Sequence[str], steps: int) -> str:
    """``rm -rf`` of the compile run's directory: its ``train.resume=never`` refuses one that holds checkpoints.

    Only where one process runs it before any rank starts (the batch script, or a single node's script).
    """
    return f"rm -rf -- {shlex.quote(str(run_dir_of(compile_overrides(cfg, overrides, steps))))}"


def _exports(env: Mapping[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def _purpose(cfg: RunConfig, compile_steps: int | None) -> list[str]:
    """Comment lines saying what the script does."""
    lines = [f"# {layout(cfg)}."]
    if compile_steps is not None:
        lines.append(
            f"# Ahead-of-time compile: the run's command under {COMPILE_WRAPPER}, {compile_steps} steps of graph "
            f"extraction (nothing is trained),\n# filling the Neuron cache {cfg.cluster.compile_cache} on each "
            "node. Then launch the run with the same overrides (hlat launch)."
        )
    return lines


def node_script(
    cfg: RunConfig,
    overrides: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    port: int = RDZV_PORT,
    compile_steps: int | None = None,
) -> str:
    """A bash script to run on every node of the job (``hlat launch --target torchrun``).

    Args:
        cfg: The validated run config.
        overrides: The Hydra overrides ``train.py`` gets, ``hydra.run.dir`` included (:func:`train_overrides`).
        env: Variables to export (e.g. ``hlat.backends.neuron.neuron_env``).
        name: Job name, used as the rendezvous id.
        port: Rendezvous port on the first node.
        compile_steps: Render the ahead-of-time compile of this many steps instead of the run.
    """
    head = ["#!/usr/bin/env bash", f"# {name}{' (compile)' if compile_steps is not None else ''}: rendered by hlat."]
    if cfg.cluster.nodes > 1:
        head.append(
            f"# Start it on each of the {cfg.cluster.nodes} nodes from the hlat checkout, with MASTER_ADDR "
            "set to the address of the first node."
        )
    lines = [*head, *_purpose(cfg, compile_steps), "set -euo pipefail"]
    if cfg.cluster.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node (the rendezvous host)}"')
    lines += [*_exports(launch_env(cfg, env)), ULIMIT]
    if compile_steps is not None and cfg.cluster.nodes == 1:
        lines.append(_fresh_compile_dir(cfg, overrides, compile_steps))
    lines.append(f"exec {_command(cfg, overrides, name, port, compile_steps)}")
    return "\n".join(lines) + "\n"


def default_cpus(cluster: ClusterConfig) -> int | None:
    """The vCPUs of one node from ``cluster.instance_type``, or None when the type is not in :data:`INSTANCE_VCPUS`."""
    return INSTANCE_VCPUS.get(cluster.instance_type or "")


def sbatch_script(
    cfg: RunConfig,
    overrides: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    cpus_per_task: int,
    port: int = RDZV_PORT,
    compile_steps: int | None = None,
) -> str:
    """A Slurm batch script for the whole job: one task per node (``srun``), each running the node's torchrun.

    The first host of the allocation hosts the rendezvous. The agents get all of their node's CPUs
    (``--cpus-per-task``), so Slurm's CPU binding does not squeeze 32 trainer processes onto one core.

    A run (not a compile) asks Slurm for SIGUSR1 ``train.preempt_grace_s`` + 10 s before the time limit, sent to the
    job steps: torchrun forwards it, the trainers checkpoint the step in flight and rank 0 leaves
    ``<run dir>/preempted.json``. torchrun's own exit status does not say that (it exits 1 after a signal), so the
    script requeues the job (``--requeue``) when that marker is there, and the requeued job continues from the
    checkpoint into the same run directory and MLflow run (``train.resume=auto``). ``scancel`` signals the batch
    shell too, so a cancelled job is not requeued.

    Args:
        cfg: The validated run config.
        overrides: The Hydra overrides ``train.py`` gets, ``hydra.run.dir`` included (:func:`train_overrides`).
        env: Variables to export (``srun`` passes them to every node).
        name: Slurm job name and rendezvous id.
        cpus_per_task: CPUs of one node (:func:`default_cpus`).
        port: Rendezvous port on the first node.
        compile_steps: Render the ahead-of-time compile of this many steps instead of the run.
    """
    c = cfg.cluster
    job = f"{name}-compile" if compile_steps is not None else name
    sbatch = [f"--job-name={job}", f"--nodes={c.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus_per_task}"]
    if c.device == "cuda" and c.backend == "torch":
        sbatch.append(f"--gpus-per-node={c.devices_per_node}")
    sbatch += ["--exclusive", "--output=%x-%j.out"]
    preemptible = compile_steps is None
    if preemptible:  # the requeued job appends to the same output file
        sbatch += [f"--signal=USR1@{launcher_grace_s(cfg.train.preempt_grace_s)}", "--requeue", "--open-mode=append"]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {s}" for s in sbatch),
        f"# Rendered by hlat; submit it from the hlat checkout: sbatch {job}.sbatch",
        *_purpose(cfg, compile_steps),
        *(["# Near its time limit the job checkpoints the step in flight and requeues itself."] if preemptible else []),
        "set -euo pipefail",
        "",
    ]
    if c.nodes > 1:
        lines += ['MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "export MASTER_ADDR"]
    lines += [*_exports(launch_env(cfg, env)), ULIMIT]
    if compile_steps is not None:
        lines.append(_fresh_compile_dir(cfg, overrides, compile_steps))
    srun = f"srun --kill-on-bad-exit=1 {_command(cfg, overrides, name, port, compile_steps)}"
    if not preemptible:
        return "\n".join([*lines, "", srun]) + "\n"
    run_dir = run_dir_of(overrides)
    if run_dir is None:
        raise ValueError("sbatch_script needs the run's hydra.run.dir (see train_overrides)")
    marker = shlex.quote(posixpath.join(run_dir, MARKER))
    lines += [
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
    return "\n".join(lines) + "\n"
