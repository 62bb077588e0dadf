"""``hlat launch`` and ``hlat compile``: compose and validate the run's config, then render (or run) its launch files.

Nothing is rendered unless the layout passes the trainer's own checks, so a bad one fails here and not on 2,048
NeuronCores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hlat.config import ConfigError, RunConfig
from hlat.deploy.k8s import FSX_CLAIM, FSX_MOUNT, pytorchjob, to_yaml
from hlat.deploy.render import (
    RDZV_PORT,
    TRAIN_SCRIPT,
    Install,
    check_name,
    compile_overrides,
    job_name,
    node_script,
    pinned_overrides,
    train_overrides,
)
from hlat.deploy.slurm import default_cpus, sbatch_script
from hlat.layouts import check_layout

SUFFIX = {"torchrun": ".sh", "slurm": ".sbatch", "eks": ".yaml"}


class UsageError(Exception):
    """Input that ``hlat launch`` / ``hlat compile`` refuses; the message says why and what to do."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="Hydra overrides as for `python train.py` (experiment=hlat_7b cluster=trn1_x64 ...)",
    )
    p.add_argument("--out", metavar="DIR", help="write the file into DIR (named after the job) instead of printing it")
    p.add_argument("--name", help="job name (default: hlat-<model>-<cluster>-<digest of the overrides>)")
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="hydra.run.dir shared by every rank, node and restart, on storage all nodes see, made absolute "
        "(default: ./outputs/<name>; on EKS <fsx mount>/hlat/<name>); ignored if the overrides set "
        "hydra.run.dir. Reuse it to continue the job from its newest checkpoint",
    )
    p.add_argument(
        "--port", type=int, default=RDZV_PORT, help=f"rendezvous port on the first node, met by hostname ({RDZV_PORT})"
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        metavar="N",
        help="Slurm: CPUs of one node (default: cluster.cpus_per_task, else from cluster.instance_type, else every "
        "CPU Slurm allocates on the node)",
    )


def parser(command: str) -> argparse.ArgumentParser:
    """The argparse parser of ``hlat launch`` or ``hlat compile``."""
    if command == "launch":
        p = argparse.ArgumentParser(
            prog="hlat launch",
            description="Render the files that start a run on a cluster: a script for every node (torchrun), a "
            "Slurm batch script, or a Kubeflow PyTorchJob for EKS. The scripts run this interpreter and this "
            "checkout's train.py by absolute path, so they start from any shell and directory on nodes that see the "
            "same paths; without tracker.uri, MLflow's store is MLFLOW_TRACKING_URI, else mlflow.db in this directory, "
            "by absolute path.",
        )
        p.add_argument(
            "--target",
            choices=["torchrun", "slurm", "eks"],
            required=True,
            help="torchrun: a bash script for every node, run with MASTER_ADDR=<the first node's hostname>; slurm: "
            "an sbatch script; eks: a Kubeflow PyTorchJob (the image's torchrun and train.py)",
        )
        p.add_argument(
            "--image",
            help="EKS (required): hlat's container image, built from the repository's "
            "Dockerfile and pushed to a registry the cluster pulls from, e.g. <account>.dkr.ecr.<region>."
            "amazonaws.com/hlat:<tag>",
        )
        p.add_argument("--fsx-claim", default=FSX_CLAIM, help=f"EKS: FSx PersistentVolumeClaim ({FSX_CLAIM})")
        p.add_argument("--fsx-mount", default=FSX_MOUNT, help=f"EKS: where FSx is mounted ({FSX_MOUNT})")
    else:
        p = argparse.ArgumentParser(
            prog="hlat compile",
            description="Ahead-of-time Neuron compile: the run's exact command under neuron_parallel_compile for a "
            "few steps, filling cluster.compile_cache, so that the run itself does not wait for the compiler.",
        )
        p.add_argument(
            "--target",
            choices=["torchrun", "slurm"],
            default="torchrun",
            help="torchrun: a bash script for every node (default); slurm: an sbatch script",
        )
        p.add_argument("--steps", type=int, default=10, help="steps to trace (10)")
        p.add_argument(
            "--run", action="store_true", help="run the compile on this node now, instead of printing the script"
        )
        sweep = p.add_argument_group('a sweep (docs/trn1.md, "Compiling a sweep")')
        sweep.add_argument(
            "-m", "--multirun", action="store_true", help="one compile job per compile group of the sweep (needs --out)"
        )
        sweep.add_argument("--config-dir", help="the sweep's directory, as `python train.py --config-dir` (sweeps)")
        sweep.add_argument("--config-name", default="config", help="the sweep's config name (precision_ablation)")
        sweep.add_argument("--plan", metavar="PLAN.json", help="the groups `hlat graphs plan -m ... --out DIR` wrote")
        sweep.add_argument(
            "--stage",
            metavar="DIR",
            help="compile into this cache on storage every node sees, and render the script that copies its finished "
            "entries into each node's cluster.compile_cache",
        )
        cache = p.add_argument_group("the compile cache")
        cache.add_argument("--audit", metavar="CACHE", help="count CACHE's entries by state per compiler version")
        cache.add_argument(
            "--distribute", metavar="STAGE", help="copy STAGE's finished entries into --to, each atomically"
        )
        cache.add_argument("--to", metavar="CACHE", help="--distribute's target: this node's local cache")
        cache.add_argument(
            "--version", help="the pinned neuronx-cc version (default: the one installed here, the image's)"
        )
    _common(p)
    return p


def compose(overrides: Sequence[str]) -> RunConfig:
    """Compose ``conf/`` with the overrides and validate it (``hlat.config.compose.compose_run_config``)."""
    from hlat.config.compose import compose_run_config

    return compose_run_config(overrides)


def run_env(cfg: RunConfig) -> dict[str, str]:
    """The variables a launch exports: the neuron backend's (precision, compiler, runtime, EFA); none on torch."""
    if cfg.cluster.backend != "neuron":
        return {}
    from hlat.backends import neuron

    return dict(neuron.neuron_env(cfg))


def install() -> Install:
    """This interpreter and the directory holding ``train.py`` (the editable checkout, else the working directory)."""
    checkout = Path(__file__).resolve().parents[3]
    for root in (checkout, Path.cwd().resolve()):
        if (root / TRAIN_SCRIPT).is_file():
            return Install(python=os.path.abspath(sys.executable), root=str(root))
    raise UsageError(
        f"no {TRAIN_SCRIPT} in {checkout} (where hlat is installed) nor in the working directory {Path.cwd()}: run "
        "hlat launch from an hlat checkout installed with pip install -e, or from the directory that holds train.py "
        "(/opt/hlat in hlat's images)"
    )


def check_cluster(cfg: RunConfig) -> None:
    """Refuse a cluster that cannot run more than one node as configured."""
    c = cfg.cluster
    if c.nodes > 1 and c.backend == "neuron" and c.efa_devices == 0:
        raise UsageError(
            f"cluster={c.name} has nodes={c.nodes} but efa_devices=0: trn1 nodes talk to each other only over EFA "
            "(8 interfaces on trn1.32xlarge; trn1.2xlarge has none). Use a multi-node preset (cluster=trn1_x4, "
            "trn1_x32, trn1_x64, trn1_x256) or set cluster.efa_devices"
        )


def prepare(args: argparse.Namespace, command: str) -> tuple[RunConfig, str, list[str], int | None]:
    """Compose and validate everything before rendering. Returns (config, job name, overrides, compile steps)."""
    cfg = compose(args.overrides)
    check_cluster(cfg)
    steps = args.steps if command == "compile" else None
    if steps is not None:
        if cfg.cluster.backend != "neuron":
            raise UsageError(
                f"hlat compile fills the Neuron compile cache with neuron_parallel_compile; cluster="
                f"{cfg.cluster.name} uses backend {cfg.cluster.backend}, which has nothing to compile ahead of time. "
                "Use a trn1 cluster"
            )
        if steps < 1:
            raise UsageError(f"--steps={steps} must be >= 1 (the steps the compile run traces); e.g. --steps 10")
        if args.run and args.target != "torchrun":
            raise UsageError("--run runs the compile on this node; with --target slurm submit the script with sbatch")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port={args.port} is not a TCP port (1-65535)")
    check_layout(cfg)  # the layout fits the cluster (ParallelDims.build) and the backend runs it, as the trainer checks
    name = args.name or job_name(cfg, args.overrides)
    check_name(name)
    if args.target == "eks":
        run_dir = args.run_dir or f"{args.fsx_mount.rstrip('/')}/hlat/{name}"
    else:
        run_dir = os.path.abspath(args.run_dir or f"outputs/{name}")
    overrides = train_overrides(pinned_overrides(cfg, args.overrides, args.target), run_dir)
    if steps is not None:
        compose(compile_overrides(cfg, overrides, steps))  # the short run must validate too
    return cfg, name, overrides, steps


def render(args: argparse.Namespace, command: str) -> tuple[str, str]:
    """Compose, validate and render. Returns (file name, text)."""
    cfg, name, overrides, steps = prepare(args, command)
    env = run_env(cfg)
    stem = f"{name}-compile" if steps is not None else name
    if args.target == "torchrun":
        text = node_script(cfg, overrides, env, name=name, install=install(), port=args.port, compile_steps=steps)
        return stem + SUFFIX["torchrun"], text
    if args.target == "slurm":
        cpus = args.cpus_per_task or cfg.cluster.cpus_per_task or default_cpus(cfg.cluster)
        text = sbatch_script(
            cfg, overrides, env, name=name, install=install(), cpus_per_task=cpus, port=args.port, compile_steps=steps
        )
        return stem + SUFFIX["slurm"], text
    if not args.image:
        raise UsageError(
            "--target eks needs --image: hlat's container image (docker build -t <registry>/hlat:<tag> "
            ". && docker push ...), pulled by every worker pod"
        )
    manifest = pytorchjob(
        cfg,
        overrides,
        env,
        name=name,
        image=args.image,
        port=args.port,
        fsx_claim=args.fsx_claim,
        fsx_mount=args.fsx_mount,
    )
    return stem + SUFFIX["eks"], to_yaml(manifest)


def _execute(text: str) -> int:
    """Run a rendered node script here (``hlat compile --run``); returns its exit status."""
    if shutil.which("neuron_parallel_compile") is None:
        raise UsageError(
            "neuron_parallel_compile is not on PATH: run `hlat compile --run` on a trn1 host with the "
            "Neuron SDK (hlat's image), or render the script and run it there"
        )
    return subprocess.run(["bash", "-c", text], env=os.environ.copy(), check=False).returncode


def cache_command(args: argparse.Namespace) -> int:
    """``hlat compile --audit CACHE`` / ``--distribute STAGE --to CACHE``: exit 0, or 1 when the audit finds trouble."""
    from hlat.deploy import neuron_cache
    from hlat.plan.graphs_command import compiler_version

    version = args.version or compiler_version()
    if args.audit:
        if not Path(args.audit).is_dir():
            raise UsageError(
                f"--audit {args.audit}: no such directory (a Neuron compile cache, e.g. cluster.compile_cache)"
            )
        print(neuron_cache.audit_text(Path(args.audit), version))
        found = neuron_cache.audit(Path(args.audit), version)
        return 1 if any(not a.matches or a.states[neuron_cache.FAILED] for a in found) else 0
    if not args.to or version is None:
        raise UsageError(
            "--distribute STAGE needs --to CACHE (this node's cluster.compile_cache) and the compiler's version "
            "(--version, or run it in the image that has neuronx-cc)"
        )
    done = neuron_cache.distribute(Path(args.distribute), Path(args.to), version)
    skipped = ", ".join(f"{n} {s}" for s, n in sorted(done.skipped.items())) or "none"
    print(f"{args.to}: {done.copied} entries copied, {done.present} already there, skipped: {skipped}")
    return 0


def main(argv: Sequence[str]) -> int:
    """``hlat launch ...`` / ``hlat compile ...`` (``argv[0]`` is the command). Returns the exit status."""
    command = argv[0]
    args = parser(command).parse_intermixed_args(list(argv[1:]))
    if command == "compile":
        args.image, args.fsx_claim, args.fsx_mount = None, FSX_CLAIM, FSX_MOUNT
        try:
            if args.audit or args.distribute:
                return cache_command(args)
            if args.multirun:
                from hlat.deploy.sweep_compile import render_sweep, stage_dir

                if args.stage:
                    args.stage = stage_dir(args.stage)
                for path in render_sweep(args, install()):
                    print(path)
                return 0
        except ConfigError as e:
            print(f"hlat: configuration error: {e}", file=sys.stderr)
            return 2
        except (UsageError, ValueError, OSError) as e:  # SweepCompileError is a ValueError
            print(f"hlat: error: {e}", file=sys.stderr)
            return 2
    try:
        filename, text = render(args, command)
        if command == "compile" and args.run:
            return _execute(text)
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        return 2
    except (UsageError, ValueError) as e:
        print(f"hlat: error: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.out) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if path.suffix == ".sh":
        path.chmod(0o755)
    print(path)
    return 0
