"""How long the trainer waits for data, per loader worker mode, in real training runs.

Runs ``hlat.train.run.main`` (the same path as ``python train.py``) for each ``data.worker`` mode and reports
the loader wait per step as a share of the step time (issue target: <= 1% for ``model=small`` on CPU).

    python bench/loader_wait.py                     # tiny and small, all worker modes
    python bench/loader_wait.py --models tiny --steps 20
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from hlat.config import register_configs, to_run_config
from hlat.train.run import main

CONF = Path(__file__).resolve().parents[1] / "conf"
SETTINGS = {  # (steps, log_every): small steps take ~10-20 s on 2 CPU cores
    "tiny": (30, 5),
    "small": (6, 2),
}


def measure(model: str, worker: str, steps: int, log_every: int, run_dir: Path) -> dict[str, float]:
    """Train ``steps`` steps; average the per-interval metrics after the first (warm-up) interval."""
    overrides = [
        f"model={model}",
        f"data.worker={worker}",
        f"train.steps={steps}",
        f"train.log_every={log_every}",
        "tracker=console",
        "optimizer.warmup_steps=1",
        "train.checkpoint_every=0",
        "train.keep_last=1",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    history = main(cfg, run_dir=run_dir).history
    rows = [row for _, row in history.rows if "perf/step_time_s" in row][1:]
    step = sum(r["perf/step_time_s"] for r in rows) / len(rows)
    wait = sum(r["perf/data_wait_s"] for r in rows) / len(rows)
    return {
        "step_s": step,
        "wait_ms": 1000 * wait,
        "wait_pct": 100 * wait / step,
        "producer_tok_s": rows[-1]["data/producer_tokens_per_s"],
    }


def main_cli() -> None:
    """Print a markdown table: model, worker, step time, wait per step, wait share, producer rate."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SETTINGS))
    parser.add_argument("--workers", nargs="+", default=["none", "thread", "process"])
    parser.add_argument("--steps", type=int, default=None, help="override the steps per run")
    args = parser.parse_args()
    register_configs()
    lines = [
        "| model | data.worker | step (s) | loader wait (ms/step) | wait share | producer tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            steps, every = SETTINGS[model]
            steps = args.steps or steps
            for worker in args.workers:
                r = measure(model, worker, steps, every, Path(tmp) / f"{model}-{worker}")
                lines.append(
                    f"| {model} | {worker} | {r['step_s']:.3f} | {r['wait_ms']:.2f} | {r['wait_pct']:.3f}% "
                    f"| {r['producer_tok_s']:,.0f} |"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    main_cli()
