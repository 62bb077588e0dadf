"""``hlat graphs plan|keys``: which arms of a sweep compile the same graphs on Trainium, known before renting trn1.

``hlat graphs plan [-m] [--config-dir D --config-name N] [overrides] [--verify KEY=a,b] [--out DIR] [--jobs N]``
takes the overrides or the multirun of ``python train.py``. Each arm is composed and validated, then its *tiny twin*
(the arm with small dimensions and a 3-step schedule, its parallel degrees capped at two processes, every traced key
kept) runs ``python train.py`` on torch-xla's CPU device with the graph ledger's fingerprints on
(``health.graph_hlo_dir``): the real NxD 0.17 traces the graphs the neuron backend would hand to neuronx-cc.
``hlat.plan.graph_groups`` groups the arms and says why groups split; ``hlat.plan.graph_schedule`` adds the graphs
that appear only later in a run and what ``hlat compile --steps N`` would miss. Writes ``plan.json`` and
``plan.md``. Needs torch-xla and NxD (the NxD lane's environment: ``.venv-neuron/bin/hlat graphs plan``).
``hlat graphs keys`` prints the key classification (``hlat.plan.graph_keys``). docs/trn1.md says what this predicts
and what only a trn1 run can settle.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, RunConfig
from hlat.config.compose import Sweep, compose_arm, search_values, sweep_arms
from hlat.parallel import ParallelDims
from hlat.plan.graph_groups import (
    Arm,
    env_signature,
    group,
    schedule_signature,
    shape_signature,
    twin_fingerprints,
    why_split,
)
from hlat.plan.graph_keys import HOST, KEYS, table
from hlat.plan.graph_schedule import coverage_gaps

TWIN_STEPS = 3
"""Steps of a twin: step 1 (AdamW's state created), step 2 (the steady optimizer), step 3 (nothing new, or a leak)."""
MAX_TWIN_ACCUM = 8
"""Micro-batches per step a twin keeps (beyond: capped, and the arm's count goes into its shape signature)."""
TWIN_MODEL = {"n_layers": 2, "n_heads": 4, "ffn_dim": 128, "vocab_size": 512, "max_seq_len": 64}
"""The twin's model: 4 heads of the arm's head size (``model.dim`` follows), 2 layers, a small MLP and vocabulary."""
TWIN_TRAIN = {"seq_len": 32, "micro_batch_size": 2}
TRACE_TIMEOUT_S = 1800.0


class UsageError(Exception):
    """Input ``hlat graphs`` refuses; the message says why and what to do."""


def parser() -> argparse.ArgumentParser:
    """The argparse parser of ``hlat graphs plan``."""
    plan = argparse.ArgumentParser(
        prog="hlat graphs plan",
        description="Trace each arm's tiny twin on torch-xla's CPU device with the real NxD and group the arms of a "
        "sweep by the graphs they compile on Trainium (docs/trn1.md). `hlat graphs keys` prints how every config key "
        "can change the graphs.",
    )
    plan.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides as for `python train.py`")
    plan.add_argument("-m", "--multirun", action="store_true", help="plan the multirun, as `python train.py -m`")
    plan.add_argument("--config-dir", help="a sweep's directory, as `python train.py --config-dir` (e.g. sweeps)")
    plan.add_argument("--config-name", default="config", help="the sweep's config name (e.g. precision_ablation)")
    plan.add_argument("--verify", metavar="KEY=a,b", help="trace the config at two values of KEY and compare")
    plan.add_argument(
        "--out", metavar="DIR", help="where plan.json, plan.md and the traces go (default: outputs/graphs/<time>)"
    )
    plan.add_argument("--jobs", type=int, default=1, metavar="N", help="twins traced at once (1)")
    plan.add_argument("--steps", type=int, default=10, help="the steps of `hlat compile --steps` to check (10)")
    plan.add_argument("--json", action="store_true", help="print plan.json instead of the summary")
    return plan


USAGE = (
    "usage: hlat graphs plan [-m] [--config-dir DIR --config-name NAME] [--verify KEY=a,b] [overrides...]\n"
    "       hlat graphs keys"
)


def main(argv: Sequence[str]) -> int:
    """``hlat graphs ...``; returns the exit status (0; 2 for a usage or configuration error)."""
    if not argv or argv[0] not in ("plan", "keys"):
        print(USAGE, file=sys.stderr if not argv or argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "keys":
        print(table())
        return 0
    args = parser().parse_intermixed_args(list(argv[1:]))
    try:
        result = plan(args)
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"hlat: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1, default=str) if args.json else summary(result))
    return 0


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Compose, trace, group and report (see the module docstring); writes ``plan.json`` and ``plan.md``."""
    if importlib.util.find_spec("torch_xla") is None or importlib.util.find_spec("neuronx_distributed") is None:
        raise UsageError(
            "hlat graphs plan traces each arm on torch-xla's CPU device with NxD: run it in the NxD lane's "
            "environment (make test-neuron builds .venv-neuron; then .venv-neuron/bin/hlat graphs plan ...)"
        )
    if args.jobs < 1:
        raise UsageError(f"--jobs={args.jobs} must be >= 1")
    search_dir = str(Path(args.config_dir).resolve()) if args.config_dir else None
    sweep = sweep_arms(args.overrides, config_name=args.config_name, search_dir=search_dir) if args.multirun else None
    sweep = sweep or Sweep("single", [list(args.overrides)], {}, args.config_name, search_dir)
    named = arms_of(sweep, args.verify)
    out = Path(args.out or f"outputs/graphs/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    arms = [make_arm(name, overrides, sweep) for name, overrides in named]
    if args.verify:  # the twin keeps the verified key's values, even one it would shrink or normalize
        for a in arms:
            a.keep = (args.verify.partition("=")[0],)
    traced = [a for a in arms if not a.refused]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda a: trace(a, out / "twins" / f"arm{arms.index(a):02d}", sweep), traced))
    result = report(arms, sweep, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "plan.md").write_text(summary(result) + "\n")
    result["out"] = str(out)
    return result


def arms_of(sweep: Sweep, verify: str | None) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each arm to trace: the grid's arms, a search's probes, or the two values of --verify."""
    base = sweep.arms[0]
    if verify:
        key, _, values = verify.partition("=")
        choices = [v for v in values.split(",") if v]
        if not key or len(choices) != 2:
            raise UsageError(f"--verify {verify!r}: give a key and two values, e.g. --verify optimizer.beta2=0.95,0.99")
        return [(f"{key}={v}", [*drop(base, key), f"{key}={v}"]) for v in choices]
    if sweep.kind == "optuna":
        return probes(sweep)
    return [(" ".join(arm) or "default", arm) for arm in sweep.arms]


def probes(sweep: Sweep) -> list[tuple[str, list[str]]]:
    """A search's probes: every searched key at a first interior value, then each key alone at a second one.

    Keys classified ``host`` only move the schedule (``graph_schedule``): they get no probe of their own, so a search
    over host keys alone traces the first probe only. Its schedule signature is that probe's: a range whose values
    reach a special learning rate (exactly 0) is not checked at its ends.
    """
    values = {k: search_values(k, v) for k, v in sweep.search.items()}
    first = [f"{k}={v[0]}" for k, v in values.items()]
    out = [("search: " + " ".join(first), [*sweep.arms[0], *first])]
    for k, v in values.items():
        if KEYS.get(k, ("", ""))[0] != HOST:
            others = [o for o in first if not o.startswith(f"{k}=")]
            out.append((f"search: {k}={v[1]}", [*sweep.arms[0], *others, f"{k}={v[1]}"]))
    return out


def drop(overrides: Sequence[str], *keys: str) -> list[str]:
    """``overrides`` without those setting one of ``keys`` (``cluster`` also drops ``cluster=...``)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys]


def make_arm(name: str, overrides: list[str], sweep: Sweep) -> Arm:
    """Compose and validate one arm and take its signatures; a refused arm is reported, not fatal."""
    from hlat.backends.neuron_plan import neuron_env

    arm = Arm(name, overrides)
    try:
        cfg = compose_arm(overrides, config_name=sweep.config_name, search_dir=sweep.search_dir)
        if cfg.cluster.backend != "neuron":
            raise ConfigError(
                f"cluster={cfg.cluster.name} runs the torch backend, which compiles nothing ahead of time: plan with "
                "the cluster the sweep will use on Trainium (cluster=trn1_1node ...) or cluster=xla_cpu"
            )
        arm.cfg, arm.shape, arm.schedule = cfg, shape_signature(cfg), schedule_signature(cfg)
        arm.env = env_signature(neuron_env(cfg), compiler_version())
    except ConfigError as e:
        arm.refused = str(e)
    return arm


def compiler_version() -> str | None:
    """The neuronx-cc installed here (the trn1 image's), or None."""
    try:
        return importlib.metadata.version("neuronx-cc")
    except importlib.metadata.PackageNotFoundError:
        return None


def twin_overrides(arm: Arm, hlo_dir: Path, run_dir: Path) -> list[str]:
    """The arm's overrides plus those that make its tiny twin (see the module docstring)."""
    cfg = arm.cfg
    assert cfg is not None
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    tp = 2 if dims.tp > 1 else 1
    pp = 2 if dims.pp > 1 and tp == 1 else 1
    dp = 2 if dims.dp > 1 and tp == pp == 1 else 1
    accum = dims.grad_accum(cfg.train)
    if accum > MAX_TWIN_ACCUM:
        arm.shape["grad_accum"] = accum  # capped in the twin: compared at full scale instead (unsure: split)
    kv = cfg.model.kv_heads
    twin_kv = 4 if kv == cfg.model.n_heads else (1 if kv < dims.tp else 2)  # MHA, replicated over tp, or GQA
    mb = TWIN_TRAIN["micro_batch_size"]
    twin = {
        **{f"model.{k}": v for k, v in TWIN_MODEL.items()},
        # The arm's head size: its attention scale head_dim^-0.5 is a scalar of the micro-batch graph, and equal
        # scalars share one input (1 / grad_accum = 1/4 = 16^-0.5 merged on a twin of head size 16).
        "model.dim": TWIN_MODEL["n_heads"] * cfg.model.head_dim,
        "model.n_kv_heads": twin_kv,
        "train.seq_len": TWIN_TRAIN["seq_len"],
        "train.micro_batch_size": mb,
        "train.global_batch_size": mb * min(accum, MAX_TWIN_ACCUM) * dp,
        "train.steps": TWIN_STEPS,
        "train.log_every": 1,
        "train.checkpoint_every": 0,
        "train.resume": "never",
        "train.init_from": "null",
        "train.checkpoint_dir": "null",
        "optimizer.warmup_steps": 1,
        "optimizer.decay_steps": "null",
        "parallelism.tp": tp,
        "parallelism.pp": pp,
        "cluster.nproc_per_node": tp * pp * dp,
        "health.graph_hlo_dir": str(hlo_dir),
        "tracker.plots": "false",
        "hydra.run.dir": str(run_dir),
    }
    twin = {k: v for k, v in twin.items() if k not in arm.keep}
    if "train.global_batch_size" in arm.keep:  # the arm's micro-batches per step, on the twin's layout
        twin.pop("train.micro_batch_size")
    groups = {"cluster": "xla_cpu", "health": "off", "tracker": "console", "fault": "none", "eval": "none"}
    keep = drop(arm.overrides, *twin, *groups)
    return [*keep, *(f"{k}={v}" for k, v in groups.items()), *(f"{k}={v}" for k, v in twin.items())]


def train_script() -> Path:
    """``train.py`` of this checkout (the editable install), else of the working directory."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / "train.py").is_file():
            return root / "train.py"
    raise UsageError("no train.py next to hlat's source nor in the working directory: run from an hlat checkout")


def trace(arm: Arm, work: Path, sweep: Sweep) -> None:
    """Run the arm's twin (``python train.py``) and read its ledgers into ``arm.twin``; a failure marks the arm."""
    from hlat.health.graph_guard import LEDGER_DIR, read_ledger

    shutil.rmtree(work, ignore_errors=True)  # a twin starts from nothing (a plan run again into the same --out)
    work.mkdir(parents=True)
    run_dir = work / "run"
    hydra = ["--config-dir", sweep.search_dir, "--config-name", sweep.config_name] if sweep.search_dir else []
    args = [sys.executable, str(train_script()), *hydra, *twin_overrides(arm, work / "hlo", run_dir)]
    (work / "command.txt").write_text(" ".join(args) + "\n")
    try:
        r = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=TRACE_TIMEOUT_S, env=os.environ)
    except subprocess.TimeoutExpired:
        arm.traced = f"the twin did not finish in {TRACE_TIMEOUT_S:.0f}s"
        return
    (work / "output.txt").write_text(r.stdout + r.stderr)
    ledgers = sorted((run_dir / LEDGER_DIR).glob("rank*.jsonl"))
    if r.returncode != 0 or not ledgers:
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        arm.traced = f"the twin failed (exit {r.returncode}: {lines[-1] if lines else 'no output'}; {work})"
        return
    arm.twin = twin_fingerprints([read_ledger(p) for p in ledgers])


def report(arms: list[Arm], sweep: Sweep, args: argparse.Namespace) -> dict[str, Any]:
    """The plan as data: arms, graph groups, compile groups, why they split, late graphs, compile coverage."""
    graph_groups = group(arms, with_schedule=True)
    compile_groups = group(arms, with_schedule=False)
    splits = []
    for groups in (graph_groups, compile_groups):
        splits.append([{"a": g[0].name, "b": h[0].name, "why": why_split(g[0], h[0])} for g, h in _pairs(groups)])
    return {
        "sweep": {"kind": sweep.kind, "config_name": sweep.config_name, "search": sweep.search},
        "verify": args.verify,
        "arms": [_arm_json(a) for a in arms],
        "graph_groups": [[a.name for a in g] for g in graph_groups],
        "compile_groups": [_compile_group(g, args.steps) for g in compile_groups],
        "splits": splits[0],
        "compile_splits": splits[1],
    }


def _pairs(groups: list[list[Arm]]) -> list[tuple[list[Arm], list[Arm]]]:
    return [(g, h) for i, g in enumerate(groups) for h in groups[i + 1 :]]


def _arm_json(a: Arm) -> dict[str, Any]:
    return {
        "name": a.name,
        "overrides": a.overrides,
        "refused": a.refused,
        "untraced": a.traced,
        "shape": a.shape,
        "env": a.env,
        "twin": a.twin,
        "schedule": a.schedule,
        "graphs": sorted({fp for rank in a.twin for fps in rank.values() for fp in fps}),
    }


def _compile_group(members: list[Arm], steps: int) -> dict[str, Any]:
    """One compile job: the member with the most late graphs represents it; what ``--steps`` would miss of each."""
    rep = max(members, key=lambda a: (len(a.schedule.get("optimizer_patterns", [])), len(a.schedule.get("late", []))))
    gaps = {a.name: coverage_gaps(a.cfg, _compile_cfg(a.cfg, steps)) for a in members if a.cfg is not None}
    return {"arms": [a.name for a in members], "representative": rep.name, "steps": steps, "missed": gaps}


def _compile_cfg(cfg: RunConfig, steps: int) -> RunConfig:
    """The schedule of ``hlat compile --steps`` for ``cfg``: the same config but ``train.steps`` (and the warmup)."""
    import dataclasses

    train = dataclasses.replace(cfg.train, steps=steps)
    warmup = min(cfg.optimizer.warmup_steps, steps - 1)
    optimizer = dataclasses.replace(cfg.optimizer, warmup_steps=warmup)
    return dataclasses.replace(cfg, train=train, optimizer=optimizer)


def summary(result: dict[str, Any]) -> str:
    """``plan.md``: the groups, why they split, the late graphs and what a short compile misses, readable."""
    arms = {a["name"]: a for a in result["arms"]}
    lines = ["# hlat graphs plan", ""]
    refused = [a for a in arms.values() if a["refused"]]
    for a in refused:
        lines.append(f"- refused: `{a['name']}`: {a['refused']}")
    graph_groups, compile_groups = result["graph_groups"], result["compile_groups"]
    lines += [
        f"{len(arms) - len(refused)} arm(s), {len(graph_groups)} graph group(s) (arms that run exactly the same "
        f"graphs), {len(compile_groups)} compile group(s) (one ahead-of-time compile each):",
        "",
    ]
    for i, g in enumerate(compile_groups, 1):
        lines.append(f"## compile group {i}: {', '.join(g['arms'])} (compile `{g['representative']}`)")
        for name in g["arms"]:
            a = arms[name]
            state = f"NOT traced: {a['untraced']}" if a["untraced"] else f"{len(a['graphs'])} distinct twin graphs"
            lines.append(f"- `{name}`: {state}")
            for late in a["schedule"].get("late", []):
                lines.append(f"  - expected after warm-up: {late}")
            for gap in g["missed"].get(name, []):
                lines.append(f"  - `hlat compile --steps {g['steps']}` misses: {gap}")
        lines.append("")
    for title, splits in (("Why graph groups split", result["splits"]), ("Why compile groups split",
                                                                          result["compile_splits"])):  # fmt: skip
        if splits:
            lines += [f"## {title}", ""]
            for s in splits:
                lines.append(f"- `{s['a']}` vs `{s['b']}`:")
                lines += [f"  - {w}" for w in s["why"]]
            lines.append("")
    return "\n".join(lines).rstrip()
