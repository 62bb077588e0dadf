"""End-of-run plots (matplotlib, written as files and logged as MLflow artifacts by ``run.py``)."""

from __future__ import annotations

import json
from pathlib import Path

Series = list[tuple[int, float]]


def training_plots(series: dict[str, Series], histogram: dict[int, int], out_dir: Path) -> list[Path]:
    """Write ``training.png`` (loss, grad norm with spikes marked, param norm, LR, spike durations) and ``spikes.json``.

    ``series``: ``(step, value)`` lists by metric (a missing one leaves its panel empty). Returns the files written.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.2))
    ax_loss, ax_gn, ax_pn, ax_lr, ax_hist = axes
    for ax, key, title in (
        (ax_loss, "train/loss", "training loss"),
        (ax_gn, "train/grad_norm", "gradient L2 norm (before clipping)"),
        (ax_pn, "train/param_norm", "parameter L2 norm"),
        (ax_lr, "train/lr", "learning rate"),
    ):
        points = series.get(key, [])
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, linewidth=0.8)
        ax.set(title=title, xlabel="step")
    active = {s for s, v in series.get("spike/active", []) if v > 0}
    spiking = [(s, v) for s, v in series.get("train/grad_norm", []) if s in active]
    if spiking:
        xs, ys = zip(*spiking, strict=True)
        ax_gn.scatter(xs, ys, s=10, color="red", zorder=3, label=f"in a spike ({len(spiking)} steps)")
        ax_gn.legend()
    if histogram:
        ax_hist.bar(list(histogram), list(histogram.values()), width=0.8)
    ax_hist.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_hist.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    n = sum(histogram.values())
    single = histogram.get(1, 0) / n if n else 0.0
    ax_hist.set(title=f"spike durations ({n} spikes, {single:.0%} single-step)", xlabel="steps", ylabel="spikes")
    fig.tight_layout()
    png = out_dir / "training.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    spikes = out_dir / "spikes.json"
    spikes.write_text(
        json.dumps(
            {"histogram": {str(k): v for k, v in histogram.items()}, "count": n, "single_step_fraction": single},
            indent=1,
        )
    )
    return [png, spikes]


def plot_eval_curves(series: dict[str, Series], out: Path) -> Path:
    """Write ``out``: one panel per ``<task>/<metric>``, against training tokens seen (the paper's Fig. 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(series)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, points) in zip(axes.flat, sorted(series.items()), strict=False):
        tokens, values = zip(*points, strict=True)
        ax.plot([t / 1e9 for t in tokens], values, marker="o", linewidth=1)
        ax.set(title=name, xlabel="training tokens (B)")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
