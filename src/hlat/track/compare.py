"""``hlat compare``: a Markdown table of the config keys that differ and the headline metrics, plus a plot.

Runs are picked by experiment, run ids or multirun directory (their ``run_dir`` tag); the report is
``comparison.md`` and ``comparison.png``. mlflow and matplotlib are imported only where needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hlat.track.runs import METRIC_KEYS, Digest, Points, RunData, select_runs, tail_mean, thin

__all__ = [
    "COMPARED",
    "METRIC_KEYS",
    "Digest",
    "RunData",
    "differing_keys",
    "digest",
    "digested",
    "main",
    "plot",
    "select_runs",
    "summary_table",
    "write_report",
]

# Params that differ from run to run without saying anything about the configuration (injected faults are
# recovered from bit-identically, so they do not change what a run computes either).
IGNORED_PREFIXES = ("hydra.", "fault.")
IGNORED_KEYS = frozenset({"tracker.run_name", "train.checkpoint_dir", "train.resume"})

_SMOOTH = 5  # moving-average window of the loss plot, in logged points
_PIXELS = 1000  # a plotted line keeps the lowest and highest point of this many step ranges (more than it has pixels)


# --------------------------------------------------------------------------------------------------- analysis


def _ignored(key: str) -> bool:
    return key.startswith(IGNORED_PREFIXES) or key in IGNORED_KEYS


def differing_keys(runs: Sequence[RunData]) -> list[str]:
    """The param keys whose values differ between the runs (or that some lack), sorted; empty for fewer than two.

    Keys that say where things go rather than what was trained (``hydra.*``, ``fault.*``...) are left out.
    """
    keys = {k for run in runs for k in run.params if not _ignored(k)}
    return sorted(k for k in keys if len({run.params.get(k) for run in runs}) > 1)


def shown_keys(runs: Sequence[RunData]) -> list[str]:
    """``differing_keys`` without those a differing preset name explains (a function of ``<group>.name``).

    So the table shows ``precision.name`` and ``optimizer.beta2`` rather than every precision field.
    """
    keys = differing_keys(runs)
    names = [k for k in keys if k.endswith(".name")]

    def explained(key: str) -> bool:
        for name in names:
            seen: dict[str | None, str | None] = {}
            if all(seen.setdefault(r.params.get(name), r.params.get(key)) == r.params.get(key) for r in runs):
                return True
        return False

    return [k for k in keys if k in names or not explained(k)]


COMPARED = (
    "train/loss",
    "train/grad_norm",
    "train/param_norm",
    "perf/tokens_per_s",
    "sys/cuda_max_allocated_gib",
    "sys/peak_rss_gib",
)
"""The metrics a comparison reads of each run's series (not the learning rate or step time: the others of
``METRIC_KEYS``)."""


def digest(run: RunData) -> Digest:
    """The run's :class:`Digest`, computed from its series on first use and kept on the run."""
    if run.digest is None:
        run.digest = _digest(run)
    return run.digest


def digested(run: RunData) -> RunData:
    """``run`` with its :class:`Digest` and without its full series (what ``select_runs(reduce=...)`` takes)."""
    return dataclasses.replace(run, metrics={}, digest=digest(run))


def _digest(run: RunData) -> Digest:
    """The :class:`Digest` of ``run``'s series (each figure as ``hlat compare`` computed it before digests)."""
    loss, gn = run.series("train/loss"), run.series("train/grad_norm")
    pn, tps = run.series("train/param_norm"), run.series("perf/tokens_per_s")
    memory = run.series("sys/cuda_max_allocated_gib") or run.series("sys/peak_rss_gib")
    finite = loss.values[~np.isnan(loss.values)]
    return Digest(
        final_loss=tail_mean(loss.values) if len(loss) else None,
        min_loss=(float(finite.min()) if len(finite) else math.nan) if len(loss) else None,
        grad_norm_median=float(np.median(gn.values[len(gn) // 2 :])) if len(gn) else None,
        param_norm=float(pn.values[-1]) if len(pn) else None,
        tokens_per_s=statistics.median(tps.values.tolist()) if len(tps) else None,
        peak_memory_gib=max(memory.values.tolist()) if len(memory) else None,
        loss_line=Points(*_envelope(loss.steps, _smooth(loss.values))) if len(loss) else Points(),
        grad_norm_line=Points(*_envelope(gn.steps, gn.values)),
        loss_points=Points.of(thin(loss)),
    )


def final_loss(run: RunData) -> float | None:
    """Mean of the last 10% of the logged loss points (at least one); ``None`` without loss points."""
    return digest(run).final_loss


def min_loss(run: RunData) -> float | None:
    """Smallest logged loss, ignoring NaN; ``None`` without loss points (NaN when every point is NaN)."""
    return digest(run).min_loss


def grad_norm_median(run: RunData) -> float | None:
    """Median gradient norm over the second half of the logged points; ``None`` without points."""
    return digest(run).grad_norm_median


def last_param_norm(run: RunData) -> float | None:
    """The last logged parameter norm; ``None`` without points."""
    return digest(run).param_norm


def median_tokens_per_s(run: RunData) -> float | None:
    """Median of the logged throughput in tokens per second; ``None`` without points."""
    return digest(run).tokens_per_s


def peak_memory_gib(run: RunData) -> float | None:
    """Peak memory of rank 0 in GiB: CUDA's allocated peak where logged, else the process's peak RSS."""
    return digest(run).peak_memory_gib


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cell(text: str) -> str:
    """A value safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def summary_table(runs: Sequence[RunData]) -> str:
    """A Markdown table, one row per run: name, id, the differing keys, then the headline metrics (``-``: missing).

    The final loss is the mean of the last 10% of logged points, as the sweep's objective.
    """
    keys = shown_keys(runs)
    head = [
        "run",
        "run id",
        *keys,
        "final loss (last 10%)",
        "min loss",
        "grad norm median (2nd half)",
        "param norm (end)",
        "tokens/s (median)",
    ]
    memory = any(peak_memory_gib(run) is not None for run in runs)
    head += ["peak memory GiB (rank 0)"] if memory else []
    align = ["---", "---", *("---" for _ in keys), *("---:" for _ in range(len(head) - 2 - len(keys)))]
    lines = [f"| {' | '.join(_cell(h) for h in head)} |", f"|{'|'.join(align)}|"]
    for run in runs:
        cells = [
            _cell(run.run_name),
            f"`{run.run_id[:8]}`",
            *(_cell(run.params.get(k, "-")) for k in keys),
            _fmt(final_loss(run), ".4f"),
            _fmt(min_loss(run), ".4f"),
            _fmt(grad_norm_median(run), ".3f"),
            _fmt(last_param_norm(run), ".2f"),
            _fmt(median_tokens_per_s(run), ",.0f"),
            *([_fmt(peak_memory_gib(run), ".2f")] if memory else []),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


GOODPUT = ("productive", "startup", "load", "save", "eval", "data_wait", "replayed", "gap")
"""The ``goodput/<name>_s`` columns of :func:`goodput_table` (hlat.track.goodput), after wall time."""


def duration(seconds: float) -> str:
    """``seconds`` in the unit that reads best: ``42.0 s``, ``35.2 min``, ``12.4 h``."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def goodput_table(runs: Sequence[RunData]) -> str | None:
    """Where each run's wall time went (its goodput ledger at its end) and its ETTR; None if no run logged one."""
    runs = [run for run in runs if "goodput/wall_s" in run.latest]
    if not runs:
        return None
    head = ["run", "run id", "attempts", "wall", *GOODPUT, "ETTR %"]
    lines = [f"| {' | '.join(head)} |", "|---|---|" + "---:|" * (len(head) - 2)]
    for run in runs:
        got = run.latest
        cells = [_cell(run.run_name), f"`{run.run_id[:8]}`", f"{got.get('goodput/attempts', 1.0):.0f}"]
        cells += [duration(got.get(f"goodput/{k}_s", 0.0)) for k in ("wall", *GOODPUT)]
        cells.append(f"{100 * got.get('goodput/ettr', 0.0):.1f}")
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def label(run: RunData, keys: Sequence[str]) -> str:
    """A legend label: the run name plus its values of ``keys``, e.g. ``bf16 (precision.name=bf16)``.

    Values the name already states are left out: a sweep job is named by its overrides (``model.mask_leak=1``).
    """
    named = {part.strip().lower() for part in run.run_name.split(",")}
    pairs = (f"{k}={run.params.get(k, '-')}" for k in keys)
    values = ", ".join(p for p in pairs if p.lower() not in named)
    return f"{run.run_name} ({values})" if values else run.run_name


def _smooth(values: Sequence[float], k: int = _SMOOTH) -> np.ndarray:
    """Trailing moving average over ``k`` points (fewer at the start)."""
    v = np.asarray(values, dtype=np.float64)
    out = np.convolve(v, np.ones(k))[: len(v)]
    out /= np.minimum(np.arange(1, len(v) + 1), k)
    return out


def _envelope(steps: Any, values: Any, buckets: int = _PIXELS) -> tuple[Any, Any]:
    """At most ``2 * buckets`` of the points: the lowest and highest of each of ``buckets`` runs of steps, in order.

    Drawn at the figure's width, the line is the full one (a 450k-step run's spikes included), at a fraction of the
    time and memory.
    """
    if len(steps) <= 2 * buckets:
        return steps, values
    keep = []
    for lo, hi in itertools.pairwise(np.linspace(0, len(steps), buckets + 1).astype(int)):
        part = values[lo:hi]
        keep += sorted({lo + int(np.argmin(part)), lo + int(np.argmax(part))})
    return steps[keep], values[keep]


def plot(runs: Sequence[RunData], path: Path | str) -> Path:
    """Write a PNG at ``path``: the loss (moving average of 5 logs) and the gradient norm (log y) of every run.

    A bare ``matplotlib.figure.Figure``, so neither pyplot nor the global backend is touched.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    path = Path(path)
    keys = shown_keys(runs)
    labels = [textwrap.fill(label(run, keys), width=150, subsequent_indent="    ") for run in runs]
    legend_lines = sum(text.count("\n") + 1 for text in labels)
    fig = Figure(figsize=(13, 4.5 + 0.2 * legend_lines), layout="constrained")  # the legend below gets its room
    ax_loss, ax_gn = fig.subplots(1, 2)
    handles = []
    for i, (run, text) in enumerate(zip(runs, labels, strict=True)):
        color = f"C{i % 10}"  # the same colour for a run in both panels
        lines = digest(run)
        if loss := lines.loss_line:
            ax_loss.plot(loss.steps, loss.values, color=color, linewidth=1.2)
        if gn := lines.grad_norm_line:
            ax_gn.plot(gn.steps, gn.values, color=color, linewidth=0.9)
        handles.append(Line2D([], [], color=color, linewidth=1.5, label=text))
    ax_loss.set(title=f"training loss (moving average of {_SMOOTH} logs)", xlabel="step", ylabel="loss")
    ax_gn.set(title="gradient L2 norm before clipping", xlabel="step", ylabel="grad norm")
    if ax_gn.lines:
        ax_gn.set_yscale("log")
    for ax in (ax_loss, ax_gn):
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    if handles:
        fig.legend(handles=handles, loc="outside lower center", fontsize="small", frameon=False)
    fig.savefig(path, dpi=110)
    return path


def write_report(runs: Sequence[RunData], out_dir: Path | str, *, title: str | None = None) -> tuple[Path, Path]:
    """Write ``comparison.md`` (title, table, link to the plot) and ``comparison.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(runs, out_dir / "comparison.png")
    md = out_dir / "comparison.md"
    title = title or f"Comparison of {len(runs)} MLflow run{'s' if len(runs) != 1 else ''}"
    goodput = goodput_table(runs)
    ledger = f"\n## Where the time went (goodput ledger)\n\n{goodput}\n" if goodput else ""
    md.write_text(f"# {title}\n\n{summary_table(runs)}\n\n![loss and gradient norm per run]({png.name})\n{ledger}")
    return md, png


# --------------------------------------------------------------------------------------------------- command line


def build_parser(prog: str = "hlat compare") -> argparse.ArgumentParser:
    """The argument parser of ``hlat compare``."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Compare MLflow runs: a Markdown table of differing config keys and headline metrics, plus a "
        "loss / gradient-norm plot.",
    )
    ap.add_argument(
        "--uri",
        help="the MLflow store (default: MLFLOW_TRACKING_URI, else tracker.uri of conf/, else ./mlflow.db); the "
        "command says on stderr which it used",
    )
    sel = ap.add_mutually_exclusive_group(required=True)
    sel.add_argument("--experiment", metavar="NAME", help="all runs of this MLflow experiment")
    sel.add_argument("--runs", metavar="ID", nargs="+", help="these MLflow run ids")
    sel.add_argument(
        "--sweep",
        metavar="DIR",
        help="the runs of this Hydra multirun directory (tag run_dir), or of the newest one under DIR (multirun/NAME)",
    )
    ap.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="output directory (default: the sweep's directory with --sweep, else comparison/)",
    )
    ap.add_argument("--all-statuses", action="store_true", help="include runs that are not FINISHED")
    return ap


def newest_sweep(path: Path) -> Path:
    """The multirun directory ``hlat compare --sweep path`` means: ``path``, else the newest one below it."""
    if (path / "multirun.yaml").is_file() or not path.is_dir():
        return path
    found = sorted(path.glob("**/multirun.yaml"), key=lambda p: (p.stat().st_mtime, str(p)))
    if not found:
        return path
    print(f"hlat compare: the newest sweep under {path}: {found[-1].parent}", file=sys.stderr)
    return found[-1].parent


def _configured_uri() -> str | None:
    """``tracker.uri`` of ``conf/`` as composed without overrides (a team's store may be set there)."""
    from hlat.config.compose import compose_run_config

    return compose_run_config([]).tracker.uri


def main(argv: list[str] | None = None) -> int:
    """Run ``hlat compare``: print the table and write the report; 2 when the selection matches nothing."""
    from hlat.config import ConfigError
    from hlat.track.mlflow_store import resolve_store

    args = build_parser().parse_args(argv)
    if args.sweep is not None:
        args.sweep = str(newest_sweep(Path(args.sweep)))
    try:
        store = resolve_store(args.uri, configured=_configured_uri)
        print(store.line("hlat compare"), file=sys.stderr)
        runs = select_runs(
            store.uri,
            experiment=args.experiment,
            run_ids=args.runs,
            sweep_dir=args.sweep,
            status=None if args.all_statuses else "FINISHED",
            keys=COMPARED,
            reduce=digested,
        )
    except (ValueError, ConfigError) as e:
        print(f"hlat compare: {e}", file=sys.stderr)
        return 2
    if args.experiment is not None:
        what = f"experiment {args.experiment}"
    elif args.sweep is not None:
        what = f"sweep {args.sweep}"
    else:
        what = "selected runs"
    out = args.out or (Path(args.sweep) if args.sweep is not None else Path("comparison"))
    md, png = write_report(runs, out, title=f"Comparison of {len(runs)} MLflow runs: {what}")
    print(summary_table(runs))
    if (goodput := goodput_table(runs)) is not None:
        print(f"\n{goodput}")
    print(f"\nreport: {md}\nplot:   {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
