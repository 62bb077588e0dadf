"""Uptime with and without automatic fault recovery, in the shape of the paper's Table 1.

    python experiments/fault_recovery/run.py                      # ~10 min on 2 cores; writes results.json here
    python experiments/fault_recovery/run.py --failures 6 --operator-delay 120
    python experiments/fault_recovery/run.py --report             # the table of the saved results.json

Both arms train the same job (the default tiny model, ``--steps`` steps, a checkpoint every ``--every`` steps) and
suffer the same ``--failures`` SIGKILLs at the same seeded random steps (``fault=kill``):

- automatic: one command, ``cluster.max_restarts=<failures>``: torch elastic restarts the trainer, which resumes
  from its newest valid checkpoint;
- manual: ``cluster.max_restarts=0``: each kill ends the job. This script plays the operator: it notices the dead
  job ``--operator-delay`` seconds later (an assumption, stated in the table) and reruns the same command, which
  resumes from the newest checkpoint (``train.resume=auto`` in the same run directory).

Uptime is hlat's own ``uptime/*`` accounting (productive step time / wall time since the job's first launch),
read from the job's single MLflow run; the script's own stopwatch of the whole job is reported next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAPER = {"automatic": 98.81, "manual": 77.83}  # arXiv 2404.10630, Table 1


def job(args: argparse.Namespace, out: Path, arm: str) -> list[str]:
    """The training command of one arm (everything but the supervision setting is shared)."""
    restarts = args.failures if arm == "automatic" else 0
    return [
        sys.executable,
        str(ROOT / "train.py"),
        f"train.steps={args.steps}",
        f"train.checkpoint_every={args.every}",
        "train.seq_len=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.log_every=5",
        f"optimizer.warmup_steps={max(1, args.steps // 10)}",
        "fault=kill",
        f"fault.kill_random={args.failures}",
        f"fault.seed={args.seed}",
        f"cluster.max_restarts={restarts}",
        f"hydra.run.dir={out / arm}",
        f"tracker.uri=sqlite:///{out / 'mlflow.db'}",
        "tracker.experiment=fault_recovery",
        f"tracker.run_name={arm}",
        "tracker.plots=false",
        "tracker.flush_every_s=1",
    ]


def run_arm(args: argparse.Namespace, out: Path, arm: str) -> dict:
    """Run one arm to completion; returns launches and the stopwatch wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.time()
    launches = 0
    while True:
        launches += 1
        with open(out / f"{arm}.log", "a") as log:
            rc = subprocess.run(job(args, out, arm), cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            break
        if arm == "automatic" or launches > args.failures + 1:
            raise SystemExit(f"{arm}: the job failed (exit {rc}); see {out / f'{arm}.log'}")
        print(f"  manual: the job died (exit {rc}); the operator reruns it in {args.operator_delay:.0f} s", flush=True)
        time.sleep(args.operator_delay)
    return {"launches": launches, "stopwatch_s": time.time() - t0}


def uptime_of(uri: str, arm: str) -> dict:
    """The last ``uptime/*`` values of the arm's MLflow run (one run per job, continued across restarts)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fault_recovery")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{arm}'")
    assert len(runs) == 1, f"{arm}: expected one MLflow run for the whole job, found {len(runs)}"
    out = {"run_id": runs[0].info.run_id, "status": runs[0].info.status}
    for key in ("wall_s", "productive_s", "lost_s", "restarts", "pct"):
        history = client.get_metric_history(runs[0].info.run_id, f"uptime/{key}")
        out[key] = max(history, key=lambda m: (m.step, m.timestamp)).value
    return out


def table(results: dict) -> str:
    """Markdown table: one row per arm, with the paper's figure next to ours."""
    rows = [
        "| recovery | failures injected | launches | restarts | wall (s) | productive (s) | lost (s) | "
        "lost per failure (s) | uptime (hlat) | uptime (paper, Table 1) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in ("automatic", "manual"):
        r = results[arm]
        per = r["lost_s"] / max(1, results["failures"])
        rows.append(
            f"| {arm} | {results['failures']} | {r['launches']} | {r['restarts']:.0f} | {r['wall_s']:.0f} | "
            f"{r['productive_s']:.0f} | {r['lost_s']:.0f} | {per:.1f} | {r['pct']:.2f}% | "
            f"{PAPER[arm]}% |"
        )
    return "\n".join(rows)


def main() -> None:
    """Run both arms (or, with --report, only print the saved table)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="checkpoint interval in steps")
    ap.add_argument("--failures", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--operator-delay", type=float, default=60.0, help="seconds until a human reruns a dead job")
    ap.add_argument("--out", type=Path, default=Path("outputs/fault_recovery"))
    ap.add_argument("--report", action="store_true", help="only print the table of the saved results.json")
    args = ap.parse_args()
    if args.report:
        print(table(json.loads((HERE / "results.json").read_text())))
        return
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    results: dict = {
        "failures": args.failures,
        "steps": args.steps,
        "checkpoint_every": args.every,
        "operator_delay_s": args.operator_delay,
        "seed": args.seed,
    }
    for arm in ("automatic", "manual"):
        print(f"{arm}: {' '.join(job(args, out, arm)[1:])}", flush=True)
        results[arm] = run_arm(args, out, arm) | uptime_of(f"sqlite:///{out / 'mlflow.db'}", arm)
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
