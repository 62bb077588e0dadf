"""``hlat compile -m``: one ahead-of-time compile job per compile group of a sweep, a manifest, a distribution step.

The groups come from ``hlat graphs plan`` (``--plan plan.json``: arms whose tiny twins traced the same graphs at the
same full-scale shapes and compiler environment, ``hlat.plan.graph_groups``), or, for an Optuna search over keys that
only move the host schedule (``hlat.plan.graph_keys``: the learning rate, the warmup), from the classification alone:
one job for every trial, none enumerated. Each job is the representative arm's compile script as ``hlat compile``
renders it (torchrun or Slurm). ``compile-manifest.json`` maps every arm to its group, with the compiler version and
flags. With ``--stage DIR`` (storage every node sees) the jobs compile into it, and a distribution script copies only
the finished entries of the pinned compiler into each node's local cache (``hlat.deploy.neuron_cache``).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import re
import shlex
import time
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, RunConfig
from hlat.config.compose import Sweep, compose_arm, sweep_arms
from hlat.deploy.render import (
    Install,
    check_name,
    compile_overrides,
    export_lines,
    pinned_overrides,
    train_overrides,
)
from hlat.deploy.slurm import default_cpus, sbatch_script
from hlat.layouts import check_layout
from hlat.plan.graph_groups import compiler_flags
from hlat.plan.graph_keys import HOST, KEYS

MANIFEST = "compile-manifest.json"


class SweepCompileError(ValueError):
    """A sweep ``hlat compile -m`` cannot render; the message says why and what to do."""


def groups_of(sweep: Sweep, plan_file: str | None) -> list[dict[str, Any]]:
    """``[{"representative": overrides, "arms": {name: overrides}}]``: from the plan, or one group for a search.

    Raises:
        SweepCompileError: a grid without a plan, a search over keys the graphs may depend on, a plan of another
            sweep.
    """
    if sweep.kind == "optuna":
        traced = [k for k in sweep.search if KEYS.get(k, ("", ""))[0] != HOST]
        if traced and plan_file is None:
            raise SweepCompileError(
                f"the search over {', '.join(traced)} may change the graphs: plan it first (hlat graphs plan -m ... "
                "--out DIR, in the NxD lane's environment) and pass --plan DIR/plan.json"
            )
        if not traced:
            from hlat.plan.graphs_command import probes

            name, overrides = probes(sweep)[0]
            space = " ".join(f"{k}={v}" for k, v in sweep.search.items())
            return [{"representative": overrides, "arms": {f"every trial of {space}": overrides}, "by": name}]
    if plan_file is None:
        raise SweepCompileError(
            "hlat compile -m needs the sweep's graph groups: run `hlat graphs plan -m <the same arguments> --out DIR` "
            "in the NxD lane's environment (.venv-neuron/bin/hlat) and pass --plan DIR/plan.json"
        )
    plan = json.loads(Path(plan_file).read_text())
    arms = {a["name"]: a["overrides"] for a in plan["arms"] if not a["refused"]}
    listed = {" ".join(arm) or "default" for arm in sweep.arms}
    if sweep.kind == "basic" and not set(arms) <= listed | {a for a in arms if a.startswith("search:")}:
        raise SweepCompileError(
            f"{plan_file} plans other arms ({sorted(arms)[:3]}...) than this sweep's ({sorted(listed)[:3]}...): plan "
            "the same sweep and overrides"
        )
    return [
        {"representative": arms[g["representative"]], "arms": {n: arms[n] for n in g["arms"]}}
        for g in plan["compile_groups"]
    ]


def _slug(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def render_sweep(args: argparse.Namespace, install: Install) -> list[Path]:
    """Write one compile script per group, the manifest and (with ``--stage``) the distribution script."""
    from hlat.plan.graphs_command import compiler_version

    if args.out is None:
        raise SweepCompileError("hlat compile -m writes several files: give --out DIR")
    search_dir = str(Path(args.config_dir).resolve()) if args.config_dir else None
    sweep = sweep_arms(args.overrides, config_name=args.config_name, search_dir=search_dir)
    groups = groups_of(sweep, args.plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = _slug(args.name or f"hlat-{args.config_name}")[:40]
    written, manifest_groups, arms = [], [], {}
    cfg: RunConfig | None = None
    for i, g in enumerate(groups):
        name = f"{base}-g{i}"
        check_name(name)
        path, cfg, flags, gaps = _render_group(args, sweep, g["representative"], name, install, out)
        written.append(path)
        manifest_groups.append(
            {"id": i, "script": path.name, "job": f"{name}-compile", "representative": g["representative"],
             "arms": sorted(g["arms"]), "compiler_flags": flags, "missed_by_the_compile_run": gaps}
        )  # fmt: skip
        arms.update(dict.fromkeys(g["arms"], i))
    assert cfg is not None, "a sweep has at least one group"
    version = compiler_version()
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sweep": {
            "config_name": args.config_name,
            "config_dir": search_dir,
            "kind": sweep.kind,
            "search": sweep.search,
        },
        "neuronx-cc": version,
        "stage": args.stage,
        "local_cache": cfg.cluster.compile_cache,
        "groups": manifest_groups,
        "arms": arms,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    written.append(out / MANIFEST)
    if args.stage:
        written.append(_distribution(args, cfg, base, install, out, version))
    return written


def _render_group(
    args: argparse.Namespace, sweep: Sweep, overrides: list[str], name: str, install: Install, out: Path
) -> tuple[Path, RunConfig, str, list[str]]:
    """One group's compile script: the representative arm's, as ``hlat compile`` renders it.

    Returns its file, the run's config (without the stage), the compiler flags and what the compile run misses.
    """
    from hlat.backends.neuron_plan import neuron_env
    from hlat.plan.graph_schedule import coverage_gaps

    arm = [*overrides, *([f"cluster.compile_cache={args.stage}"] if args.stage else [])]
    compose = {"config_name": sweep.config_name, "search_dir": sweep.search_dir}
    cfg = compose_arm(arm, **compose)  # compiles into the stage; the runs read their cluster.compile_cache
    local = compose_arm(overrides, **compose) if args.stage else cfg
    if cfg.cluster.backend != "neuron":
        raise ConfigError(f"cluster={cfg.cluster.name} uses the torch backend: hlat compile needs a trn1 cluster")
    check_layout(cfg)
    run_dir = os.path.abspath(args.run_dir or f"outputs/{name}")
    hydra = ["--config-dir", sweep.search_dir, "--config-name", sweep.config_name] if sweep.search_dir else []
    run = train_overrides(pinned_overrides(cfg, arm, args.target), run_dir)
    short = compile_overrides(cfg, run, args.steps)
    gaps = coverage_gaps(cfg, compose_arm(short, **compose))
    env = neuron_env(cfg)
    words = [*hydra, *run]
    if args.target == "slurm":
        cpus = args.cpus_per_task or cfg.cluster.cpus_per_task or default_cpus(cfg.cluster)
        text = sbatch_script(cfg, words, env, name=name, install=install, cpus_per_task=cpus, port=args.port,
                             compile_steps=args.steps)  # fmt: skip
        suffix = ".sbatch"
    else:
        from hlat.deploy.render import node_script

        text = node_script(cfg, words, env, name=name, install=install, port=args.port, compile_steps=args.steps)
        suffix = ".sh"
    note = [f"# Compile group of sweep {sweep.config_name}: {' '.join(overrides) or 'the defaults'}"]
    note += [f"# Not traced by this {args.steps}-step compile (compiled at run time): {g}" for g in gaps]
    head, _, rest = text.partition("\n")
    path = out / f"{name}-compile{suffix}"
    path.write_text("\n".join([head, *note, rest]))
    if suffix == ".sh":
        path.chmod(0o755)
    return path, local, compiler_flags(env["NEURON_CC_FLAGS"]), gaps


def _distribution(
    args: argparse.Namespace, cfg: RunConfig, base: str, install: Install, out: Path, version: str | None
) -> Path:
    """The script that copies the stage's finished entries into every node's local cache (before the runs)."""
    local = cfg.cluster.compile_cache
    command = [install.python, "-m", "hlat.cli", "compile", "--distribute", args.stage, "--to", local]
    command += ["--version", version] if version else []
    line = shlex.join(command)
    lines = ["# Copy the finished entries of the pinned compiler from the stage into this node's local cache.",
             "set -euo pipefail", *install.setup_lines(), *export_lines({})]  # fmt: skip
    if args.target == "slurm":
        nodes = cfg.cluster.nodes
        head = ["#!/bin/bash", f"#SBATCH --job-name={base}-distribute", f"#SBATCH --nodes={nodes}",
                "#SBATCH --ntasks-per-node=1", "#SBATCH --output=%x-%j.out"]  # fmt: skip
        body = [*lines, f"srun --ntasks-per-node=1 {line}"]
        path = out / f"{base}-distribute.sbatch"
    else:
        head = ["#!/usr/bin/env bash", f"# Run on each of the {cfg.cluster.nodes} node(s) before the sweep's runs."]
        body = [*lines, line]
        path = out / f"{base}-distribute.sh"
    path.write_text("\n".join([*head, *body]) + "\n")
    if path.suffix == ".sh":
        path.chmod(0o755)
    return path


def stage_dir(path: str) -> str:
    """``--stage``: an absolute path (every node must find it at the same place)."""
    if not posixpath.isabs(path):
        raise SweepCompileError(f"--stage {path}: give an absolute path on storage every node mounts (e.g. /fsx/...)")
    return path
