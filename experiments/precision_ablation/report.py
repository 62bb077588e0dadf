"""Table and plot of the precision ablation, read back from the MLflow runs of ``sweeps/precision_ablation.yaml``.

    python experiments/precision_ablation/report.py                  # ./mlflow.db, experiment precision_ablation
    python experiments/precision_ablation/report.py --uri sqlite:///other.db --out /tmp/plot.png

For each arm (the run name) it takes the newest finished run and prints a markdown table: final loss (mean over the
last 10% of logged steps), its gap to fp32, the gradient-norm median and maximum over the second half, and the final
parameter norm. The plot shows the loss, the loss minus the fp32 run's loss at the same step (every arm sees the
same batches), and the gradient norm.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("fp32", "master_weights", "bf16_sr", "bf16", "bf16_sr-beta2-0.99")


def load_runs(uri: str, experiment: str) -> dict[str, dict]:
    """Newest FINISHED run per run name: ``{name: {"id": ..., "loss": [(step, v)], "grad_norm": ..., ...}}``."""
    from hlat.track.runs import select_runs

    try:
        runs = select_runs(uri, experiment=experiment)  # oldest first
    except ValueError as e:
        raise SystemExit(f"{e} (run the sweep first, see README.md)") from None
    newest = {r.run_name: r for r in runs}  # a later run of the same arm replaces an earlier one
    return {
        name: {
            "id": r.run_id,
            "params": r.params,
            "loss": r.series("train/loss"),
            "grad_norm": r.series("train/grad_norm"),
            "param_norm": r.series("train/param_norm"),
        }
        for name, r in newest.items()
    }


def table(runs: dict[str, dict]) -> str:
    """The markdown result table."""
    ref = None
    rows = []
    for name in [a for a in ARMS if a in runs] + sorted(set(runs) - set(ARMS)):
        r = runs[name]
        loss = [v for _, v in r["loss"]]
        tail = loss[-max(1, len(loss) // 10) :]
        final = statistics.fmean(tail)
        ref = final if name == "fp32" else ref
        half = [v for _, v in r["grad_norm"][len(r["grad_norm"]) // 2 :]]
        rows.append(
            f"| {name} | {r['params'].get('optimizer.beta2', '?')} | {r['loss'][-1][0]} | {final:.4f} | "
            f"{'-' if ref is None or name == 'fp32' else f'{final - ref:+.4f}'} | {min(loss):.4f} | "
            f"{statistics.median(half):.3f} | {max(half):.3f} | {r['param_norm'][-1][1]:.2f} | `{r['id'][:8]}` |"
        )
    head = (
        "| arm | beta2 | steps | final loss (last 10%) | vs fp32 | min loss | grad norm median (2nd half) | "
        "grad norm max (2nd half) | param norm (end) | MLflow run |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    return "\n".join([head, *rows])


def _smooth(values: list[float], k: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(runs: dict[str, dict], path: Path) -> None:
    """Loss, loss minus the fp32 run's loss (same batches, so the gap is low-noise) and gradient norm per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap, ax_gn) = plt.subplots(1, 3, figsize=(16, 4.5))
    ref = dict(runs["fp32"]["loss"]) if "fp32" in runs else None
    for name in [a for a in ARMS if a in runs] + sorted(set(runs) - set(ARMS)):
        steps, loss = zip(*runs[name]["loss"], strict=True)
        ax_loss.plot(steps, _smooth(loss), label=name, linewidth=1.2)
        if ref is not None:
            gap = [(s, v - ref[s]) for s, v in runs[name]["loss"] if s in ref]
            ax_gap.plot([s for s, _ in gap], _smooth([g for _, g in gap], 10), label=name, linewidth=1.2)
        gsteps, gn = zip(*runs[name]["grad_norm"], strict=True)
        ax_gn.plot(gsteps, _smooth(gn), label=name, linewidth=0.9)
    ax_loss.set(title="training loss (moving average of 5 logs)", xlabel="step", ylabel="loss")
    ax_gap.axhline(0.0, color="grey", linewidth=0.6)
    ax_gap.set(title="loss minus fp32 loss, same batches (moving average of 10)", xlabel="step")
    ax_gn.set(title="gradient L2 norm before clipping (moving average of 5)", xlabel="step", yscale="log")
    ax_loss.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Print the table and write the plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uri", default="sqlite:///mlflow.db", help="MLflow tracking URI (default: ./mlflow.db)")
    ap.add_argument("--experiment", default="precision_ablation")
    ap.add_argument("--out", type=Path, default=HERE / "precision_ablation.png", help="where to write the plot")
    args = ap.parse_args()
    runs = load_runs(args.uri, args.experiment)
    print(table(runs))
    plot(runs, args.out)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
