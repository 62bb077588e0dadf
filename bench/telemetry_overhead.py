"""Telemetry overhead: step time with ``tracker=mlflow`` against ``tracker=console``, logging every step.

    python bench/telemetry_overhead.py                      # model=small, bf16, 8 x 256 tokens, 2 rounds x 8 steps
    python bench/telemetry_overhead.py --model tiny --steps 20

Each measurement is a real ``hlat.train.run.main`` run (the path of ``python train.py``) with ``train.log_every=1``, so
every step is fetched, turned into metrics (loss, grad norm, LR, spike statistics, throughput, MFU, memory, loader
statistics) and handed to the tracker; the MLflow store is a fresh sqlite file. Rounds alternate the two trackers.
Reported per tracker: the median step time over the steps after the first (from ``perf/step_time_s``, which covers
everything the training thread does between two steps, the tracker call included) and the time the training thread
spent inside the tracker's ``log_metrics`` (the only telemetry work that can delay a step; MLflow's sends run in a
background thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from hlat.config import register_configs, to_run_config
from hlat.track import trackers
from hlat.train.run import main as run_main

CONF = Path(__file__).resolve().parents[1] / "conf"


def one_run(kind: str, args: argparse.Namespace, workdir: Path) -> tuple[list[float], float, int]:
    """Step times (s) after the first step, seconds spent in ``log_metrics``, metric points logged."""
    spent = [0.0, 0]
    real = trackers.MultiTracker.log_metrics

    def timed(self, rows):
        t0 = time.perf_counter()
        real(self, rows)
        spent[0] += time.perf_counter() - t0
        spent[1] += sum(len(r) for _, r in rows)

    trackers.MultiTracker.log_metrics = timed
    try:
        overrides = [
            f"model={args.model}",
            f"precision={args.precision}",
            f"tracker={kind}",
            "train.log_every=1",
            f"train.steps={args.steps}",
            "optimizer.warmup_steps=1",
            f"train.seq_len={args.seq_len}",
            f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.batch}",
            "train.checkpoint_every=0",
            "tracker.plots=false",
            f"tracker.uri=sqlite:///{workdir / 'mlflow.db'}",
        ]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = to_run_config(compose(config_name="config", overrides=overrides))
        result = run_main(cfg, run_dir=workdir / f"{kind}-{time.time_ns()}")
    finally:
        trackers.MultiTracker.log_metrics = real
    times = [v for s, v in result.history.series("perf/step_time_s") if s > 1]
    return times, spent[0], spent[1]


def main() -> None:
    """Run the comparison and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    register_configs()
    kinds = ("console", "mlflow")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    inside: dict[str, float] = dict.fromkeys(kinds, 0.0)
    points: dict[str, int] = dict.fromkeys(kinds, 0)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        for _ in range(args.rounds):
            for kind in kinds:
                t, s, n = one_run(kind, args, Path(tmp))
                times[kind] += t
                inside[kind] += s
                points[kind] += n
    steps = args.rounds * args.steps
    med = {k: statistics.median(times[k]) for k in kinds}
    print(
        f"- model={args.model}, precision={args.precision}, {args.batch} x {args.seq_len} tokens per step, "
        f"train.log_every=1; {args.rounds} rounds x {args.steps} steps per tracker, alternating"
    )
    print()
    print("| tracker | median step (s) | min-max step (s) | in log_metrics per step (ms) | metric points per step |")
    print("|---|---:|---:|---:|---:|")
    for k in kinds:
        print(
            f"| {k} | {med[k]:.3f} | {min(times[k]):.3f}-{max(times[k]):.3f} | "
            f"{inside[k] / steps * 1e3:.2f} | {points[k] / steps:.0f} |"
        )
    print()
    print(
        f"- step time mlflow / console: {med['mlflow'] / med['console']:.4f} "
        f"({(med['mlflow'] / med['console'] - 1):+.2%})"
    )
    print(
        f"- MLflow's blocking cost: {inside['mlflow'] / steps * 1e3:.2f} ms per step = "
        f"{inside['mlflow'] / steps / med['mlflow']:.3%} of the step"
    )


if __name__ == "__main__":
    main()
