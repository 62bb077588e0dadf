"""The trainer as users run it: start-up time, first step, steady tokens/s and MFU, and where a step's time goes.

    python bench/trainer_profile.py                        # model=small, fp32 and bf16, torch.compile off and on
    python bench/trainer_profile.py --quick                # model=tiny, a few steps: a smoke run, don't quote it
    python bench/trainer_profile.py --configs "model=tiny" "model=small precision=bf16 train.compile=true"

Every row is one ``python train.py <overrides>`` in a fresh process, exactly as a user starts it, with
``train.step_breakdown=true`` and an MLflow store (sqlite) of its own; the numbers are read back from MLflow:

- **wall s**: the whole command, from ``exec`` to exit (interpreter, imports, Hydra, the run, the final checkpoint,
  MLflow's shutdown), timed by this script.
- **start-up s**: ``perf/startup_s``, from the process's start to the first training step: imports, config
  composition and validation, the memory plan, the data loader (tokenizer loaded, not trained: the builtin corpus and
  its tokenizer are built once before the first row), the model built and initialized, the MLflow run opened.
- **first step s**: ``perf/first_step_s``, the first step itself; with ``train.compile=true`` it holds inductor's
  compilation (its on-disk cache is warmed before the first row, as a user's second run would find it).
- **tokens/s, MFU**: the median of ``perf/tokens_per_s`` / ``perf/mfu`` over the log intervals after the first one
  (MFU against this host's ``hlat bench peak``, measured first if not cached).
- **breakdown**: ``time/*_s``, the median over the same intervals of each phase's seconds per step (data wait,
  forward, backward, optimizer = clip + step + zero_grad, logging = the metrics hook, checkpoint = how long the
  checkpoint hook blocks the loop, other = the rest of ``perf/step_time_s``). On a CPU every phase is synchronous,
  so the split is exact; on CUDA the timer synchronizes at each phase boundary (that is why the breakdown is off by
  default).

Rows are repeated ``--repeats`` times, interleaved, and the median reported. The report is markdown for
bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("data_wait", "forward", "backward", "optimizer", "logging", "checkpoint", "other")
DEFAULT_CONFIGS = (
    "model=small precision=fp32",
    "model=small precision=fp32 train.compile=true",
    "model=small precision=bf16",
    "model=small precision=bf16 train.compile=true",
)


def common(args: argparse.Namespace) -> list[str]:
    """Overrides every row shares: the batch, the steps, logging and checkpointing, no plots."""
    return [
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        f"train.seq_len={args.seq_len}",
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        f"train.checkpoint_every={args.checkpoint_every}",
        "optimizer.warmup_steps=1",
        "train.step_breakdown=true",
        "tracker.plots=false",
        "tracker.system_metrics=false",
    ]


def run_once(config: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """One ``python train.py`` of ``config``; its figures (see the module docstring)."""
    run_dir = workdir / f"run-{time.time_ns()}"
    db = run_dir / "mlflow.db"
    run_dir.mkdir()
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *shlex.split(config),
        *common(args),
        f"tracker.uri=sqlite:///{db}",
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"wall_s": wall, **read_metrics(db)}


def read_metrics(db: Path) -> dict[str, float]:
    """Start-up, first step, and the medians over the steady log intervals, from the run's MLflow store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def steady(key: str) -> float:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        values = [v for _, v in points[1:]] or [v for _, v in points]  # the first interval holds the first step
        return statistics.median(values) if values else float("nan")

    out = {k: run.data.metrics[f"perf/{k}"] for k in ("startup_s", "first_step_s")}
    out |= {k: steady(f"perf/{k}") for k in ("tokens_per_s", "step_time_s", "mfu")}
    out |= {p: steady(f"time/{p}_s") for p in PHASES}
    return out


def warm_caches(args: argparse.Namespace, configs: list[str], workdir: Path) -> None:
    """Build the builtin corpus and tokenizer, the matmul peak and inductor's cache once, before anything is timed."""
    subprocess.run([sys.executable, "-m", "hlat.cli", "bench", "peak"], check=True, capture_output=True)
    warm = argparse.Namespace(**{**vars(args), "steps": 2, "log_every": 1, "checkpoint_every": 0})
    for config in dict.fromkeys(configs):
        run_once(config, warm, workdir)


def report(
    configs: list[str],
    results: dict[str, list[dict[str, float]]],
    args: argparse.Namespace,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    seconds: float,
) -> str:
    """The markdown report."""
    import torch

    from hlat.host import host_info

    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in results.items()}
    head = "| overrides | wall s | start-up s | first step s | tokens/s | MFU | step s | " + " | ".join(PHASES) + " |"
    command = shlex.join(["python", "bench/trainer_profile.py", *sys.argv[1:]])
    lines = [
        f"`{command}`",
        "",
        f"- machine: {host_info()}, {platform.platform()}",
        f"- python {platform.python_version()}, torch {torch.__version__}",
        f"- every row: {' '.join(common(args))}; median of {args.repeats} run(s), interleaved",
        f"- load average at start {load[0]}, at end {load[1]}; wall time {seconds:.0f} s",
        "",
        head,
        "|---|" + "---:|" * (6 + len(PHASES)),
    ]
    for c in configs:
        m = med[c]
        phases = " | ".join(f"{m[p]:.3f}" for p in PHASES)
        row = f"| `{c}` | {m['wall_s']:.1f} | {m['startup_s']:.1f} | {m['first_step_s']:.2f} | "
        row += f"{m['tokens_per_s']:,.0f} | {100 * m['mfu']:.1f}% | {m['step_time_s']:.3f} | {phases} |"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    """Run every config ``--repeats`` times, interleaved, and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="override strings, one per row")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=3)
    ap.add_argument("--checkpoint-every", type=int, default=6, help="0: no checkpoint before the final one")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="model=tiny, 4 steps, one repeat: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.configs = ["model=tiny", "model=tiny train.compile=true"]
        args.steps, args.log_every, args.checkpoint_every, args.repeats, args.seq_len = 4, 2, 2, 1, 128
    start, load0 = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        warm_caches(args, args.configs, workdir)
        results: dict[str, list[dict[str, float]]] = {c: [] for c in args.configs}
        for i in range(args.repeats):
            order = args.configs[i % len(args.configs) :] + args.configs[: i % len(args.configs)]
            for config in order:
                results[config].append(run_once(config, args, workdir))
    load = (tuple(round(x, 2) for x in load0), tuple(round(x, 2) for x in os.getloadavg()))
    print(report(args.configs, results, args, load, time.perf_counter() - start))


if __name__ == "__main__":
    main()
