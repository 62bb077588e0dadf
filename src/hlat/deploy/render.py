"""The trainer's command line on one node, and the per-node script around it (``hlat.deploy.slurm``: the sbatch).

One ``torchrun`` per node, meeting in a c10d rendezvous on the first node; every rank and restart writes one pinned
``hydra.run.dir``, where ``train.resume=auto`` looks. The scripts assume nothing of the submitting shell: they run
hlat's interpreter on the absolute path of ``train.py`` (:class:`Install`).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hlat.config import RunConfig
from hlat.launch.preempt import AGENT_SIGNALS, launcher_grace_s
from hlat.launch.rendezvous import RDZV_PORT  # the c10d store's port on the first node, as python train.py's
from hlat.parallel import ParallelDims
from hlat.track.provenance import is_secret_name

NOFILE = 65535
"""Open-file limit for the trainer processes (NxD's Llama example scripts raise it to this value)."""
ULIMIT = f'ulimit -n {NOFILE} 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true'
"""Raise the open-file limit, or to the hard limit where that is lower; a failed ``ulimit`` must not end the job,
which runs under ``set -e``."""
TRAIN_SCRIPT = "train.py"
TORCHRUN_MODULE = "torch.distributed.run"
"""What ``torchrun`` runs: ``<python> -m torch.distributed.run`` needs nothing on ``PATH``."""
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
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Install:
    """Where hlat is installed on the nodes, as absolute paths (the same on every node: a shared file system).

    ``python`` is ``sys.executable`` unresolved: a venv's ``bin/python`` symlink is what makes it the venv.
    """

    python: str
    root: str

    def __post_init__(self) -> None:
        if not (posixpath.isabs(self.python) and posixpath.isabs(self.root)):
            raise ValueError(f"Install paths must be absolute, got python={self.python!r} root={self.root!r}")

    @property
    def train_script(self) -> str:
        """The absolute path of ``train.py``."""
        return posixpath.join(self.root, TRAIN_SCRIPT)

    def setup_lines(self) -> list[str]:
        """Shell lines that put the environment's ``bin`` first on ``PATH`` and enter the checkout."""
        bin_dir = shlex.quote(posixpath.dirname(self.python))
        return [f'export PATH={bin_dir}:"$PATH"', f"cd {shlex.quote(self.root)}"]


class ShellWord(str):
    """A word that goes into a shell script as written, because it expands a variable (``"$MASTER_ADDR:29400"``)."""


def override_key(override: str) -> str:
    """The config key that an override sets: ``train.steps=5`` gives ``train.steps``, ``+a.b=1`` gives ``a.b``."""
    return override.split("=", 1)[0].lstrip("+~")


def job_name(cfg: RunConfig, overrides: Sequence[str]) -> str:
    """The default job name: ``hlat-<model>-<cluster>-<6 hex digits of the overrides>``.

    Other configurations get other run directories (never each other's checkpoints); the same command continues.
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
            "ending with '-' (a Kubernetes DNS-1035 label); pass such a name with --name, e.g. --name hlat-7b"
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

    The Neuron cache is keyed by the traced graphs and compiler flags, so only :data:`HOST_ONLY_KEYS` change
    (appended last): the steps and warmup, no resume or checkpoints of the real run's, a console tracker.
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


def pinned_overrides(cfg: RunConfig, overrides: Sequence[str], target: str) -> list[str]:
    """``overrides`` plus ``tracker.uri=<the store>`` where the config names none.

    That store is this shell's ``MLFLOW_TRACKING_URI``, else the default ``mlflow.db`` here, by absolute path. The
    nodes need not share this shell's environment and the default store is per working directory; pinned here, every
    node and requeue writes one store (not on EKS, whose pods have their image's paths). A URI that carries a
    password is not written into a launch file: the job's environment must set ``MLFLOW_TRACKING_URI`` then.
    """
    if target == "eks" or cfg.tracker.kind != "mlflow":
        return list(overrides)
    from urllib.parse import urlsplit

    from hlat.track.mlflow_store import DEFAULT, ENV_URI, command_store

    store = command_store(cfg.tracker.uri, overrides)
    if store.source == DEFAULT or (store.source == ENV_URI and "@" not in urlsplit(store.uri).netloc):
        return [*overrides, f"tracker.uri={store.uri}"]
    return list(overrides)


def torchrun_argv(
    cfg: RunConfig, overrides: Sequence[str], *, endpoint: str, rdzv_id: str, install: Install | None = None
) -> list[str]:
    """``torchrun ... train.py <overrides>`` for one node of ``cfg.cluster``, as a list of words.

    Several nodes meet at ``endpoint``, the first node's ``host:port``. Without ``install``, bare ``torchrun
    train.py`` (a container image's ``PATH`` and working directory provide both).
    """
    # The endpoint names a hostname: torch picks the agent that hosts the c10d store by comparing it with its own.
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
    launcher, script = (
        (["torchrun"], TRAIN_SCRIPT)
        if install is None
        else ([install.python, "-m", TORCHRUN_MODULE], install.train_script)
    )
    return [*launcher, *words, "--max-restarts", str(c.max_restarts), script, *overrides]


def shell_join(words: Sequence[str]) -> str:
    """Quote each word for the shell (``shlex.quote``) except the :class:`ShellWord` ones."""
    return " ".join(w if isinstance(w, ShellWord) else shlex.quote(w) for w in words)


def torchrun_line(
    cfg: RunConfig, overrides: Sequence[str], *, rdzv_id: str, port: int = RDZV_PORT, install: Install | None = None
) -> str:
    """The per-node torchrun command as one shell line. It meets at ``$MASTER_ADDR:<port>``, the first node."""
    endpoint = ShellWord(f'"$MASTER_ADDR:{port}"')
    return shell_join(torchrun_argv(cfg, overrides, endpoint=endpoint, rdzv_id=rdzv_id, install=install))


def launch_env(cfg: RunConfig, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus what every launch exports: the Neuron compile cache, and torchrun's signals and grace period.

    Variables rather than torchrun's flags: an older torchrun ignores them where it would refuse the flags. A launch
    file is shared, so it never holds a credential.

    Raises:
        ValueError: a name that is not a shell variable name, or one that looks like a credential's.
    """
    out = {k: str(v) for k, v in env.items()}
    if cfg.cluster.backend == "neuron":
        out.setdefault("NEURON_COMPILE_CACHE_URL", cfg.cluster.compile_cache)
    out.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    out.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(launcher_grace_s(cfg.train.preempt_grace_s)))
    bad = [k for k in out if not _ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"environment variable names {bad} are not valid shell names")
    secret = [k for k in out if is_secret_name(k)]
    if secret:
        raise ValueError(
            f"environment variables {secret} look like credentials, and a launch file must not hold one: set them in "
            "the environment the job starts in (exported before sbatch or the node script; a Kubernetes Secret on EKS)"
        )
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


def command_text(
    cfg: RunConfig, overrides: Sequence[str], name: str, port: int, compile_steps: int | None, install: Install
) -> str:
    """The torchrun command (wrapped in neuron_parallel_compile for a compile), broken before ``train.py``."""
    endpoint = ShellWord(f'"$MASTER_ADDR:{port}"')
    if compile_steps is not None:
        overrides = compile_overrides(cfg, overrides, compile_steps)
    words = torchrun_argv(cfg, overrides, endpoint=endpoint, rdzv_id=name, install=install)
    if compile_steps is not None:
        words = [COMPILE_WRAPPER, *words]
    cut = words.index(install.train_script)
    return f"{shell_join(words[:cut])} \\\n  {shell_join(words[cut:])}"


def fresh_compile_dir(cfg: RunConfig, overrides: Sequence[str], steps: int) -> str:
    """``rm -rf`` of the compile run's directory (its ``train.resume=never`` refuses one holding checkpoints).

    Only where one process runs it before any rank starts (the batch script, or a single node's script).
    """
    return f"rm -rf -- {shlex.quote(str(run_dir_of(compile_overrides(cfg, overrides, steps))))}"


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export NAME=value`` lines, each value quoted for the shell (:func:`launch_env` checked the names)."""
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def purpose_lines(cfg: RunConfig, compile_steps: int | None) -> list[str]:
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
    install: Install,
    port: int = RDZV_PORT,
    compile_steps: int | None = None,
) -> str:
    """A bash script to run on every node of the job (``hlat launch --target torchrun``).

    ``name`` is the rendezvous id; ``compile_steps`` renders the ahead-of-time compile instead of the run.
    """
    head = ["#!/usr/bin/env bash", f"# {name}{' (compile)' if compile_steps is not None else ''}: rendered by hlat."]
    if cfg.cluster.nodes > 1:
        head.append(
            f"# Start it on each of the {cfg.cluster.nodes} nodes, from any directory, with MASTER_ADDR set to the "
            "hostname of the first node\n# (the name that node calls itself: torch picks the rendezvous host by "
            "hostname, an IP address may not match)."
        )
    lines = [*head, *purpose_lines(cfg, compile_steps), "set -euo pipefail"]
    if cfg.cluster.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the hostname of the first node (the rendezvous host)}"')
    lines += [*install.setup_lines(), *export_lines(launch_env(cfg, env)), ULIMIT]
    if compile_steps is not None and cfg.cluster.nodes == 1:
        lines.append(fresh_compile_dir(cfg, overrides, compile_steps))
    lines.append(f"exec {command_text(cfg, overrides, name, port, compile_steps, install)}")
    return "\n".join(lines) + "\n"
