"""Tracking at the paper's scale: write, read and compare a long run through hlat's own trackers, before and after.

    python bench/tracking_scale.py                         # 450k steps into a fresh sqlite store (the paper's 7B run)
    python bench/tracking_scale.py --steps 50000           # a quick run; sizes and read times extrapolated to 450k
    python bench/tracking_scale.py --uri http://127.0.0.1:5000 --steps 50000   # a tracking server (any backend)

Both arms drive N synthetic steps the way the trainer does: one ``log_metrics`` call per log interval of 10 steps,
with the trainer's metric set (loss, grad norm, lr and four ``spike/*`` every step, 27 interval metrics on the
interval's last step: about 9.4 points a step), into ``MultiTracker`` + ``MLflowTracker`` flushing every 5 s.

- before: every point to MLflow (hlat before the Parquet series), no series; ``hlat compare`` reads MLflow histories.
- after: what ``build_tracker`` builds now: the Parquet :class:`~hlat.track.series.SeriesWriter` (a part at each
  checkpoint, every ``--checkpoint-every`` steps) and MLflow through :class:`~hlat.track.series.LeanTracker`, at the
  stride a ``--scale-to``-step run has (:func:`~hlat.track.series.store_every`: 100 steps at 450k).

Measured per arm: write throughput (points given to the tracker / seconds until the last is stored), the caller's
time per ``log_metrics`` call (p50, p99), the series write per checkpoint (after), points stored, the store size (a
sqlite store: the size of the database file, one per arm, plus the artifacts; a server: not measured here, query
its database, e.g. PostgreSQL's ``pg_database_size``), ``get_metric_history('train/loss')``, ``hlat compare --runs
<the run>`` (wall time and peak RSS of its own process), and with a server the UI's sampled chart endpoint
(``get-history-bulk-interval``, 320 points). Sizes and read times at fewer steps are extrapolated linearly to
``--scale-to`` steps (the table says so).

``hlat compare`` of one run and of a sweep (after): beside the after arm's run, ``--compare-runs`` - 1 more runs get a
series of as many steps of their own (the loss offset per run, written as the trainer writes it: a part per
checkpoint logged as an artifact, compacted at the end; their params and last values in MLflow, not the lean store's
histories, which ``hlat compare`` does not read for a run with a series). ``hlat compare --runs`` of the first run and
of all of them is timed ``--repeat`` times, in its own process each: wall time, CPU time (user + system, which the
load of a shared machine changes less) and its peak RSS (its own ``VmHWM``: not ``ru_maxrss``, which for a process
started by this big one includes this one's RSS at the fork, because Linux keeps the larger across ``exec``). With
``--baseline-src`` (the ``src/`` of another checkout, e.g. ``git worktree add /tmp/base main``) the same commands
run that code too, interleaved, and the reports (``comparison.md`` and ``.png``) of both are compared byte for byte.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hlat.config import TrackerConfig
from hlat.track.series import SERIES_DIR, LeanTracker, SeriesWriter, store_every
from hlat.track.trackers import MLflowTracker, MultiTracker, Rows

PER_STEP = ("train/loss", "train/grad_norm", "train/lr", "spike/active", "spike/length", "spike/count", "spike/limit")
INTERVAL = (
    "train/param_norm",
    "train/tokens_seen",
    "fault/skipped_updates",
    "fault/rollbacks",
    "fault/discarded_batches",
    "perf/tokens_per_s",
    "perf/sequences_per_s",
    "perf/step_time_s",
    "perf/data_wait_s",
    "sys/peak_rss_gib",
    "perf/model_tflops",
    "perf/mfu",
    "perf/mfu_causal",
    "perf/cost_per_4m_tokens",
    "uptime/wall_s",
    "uptime/productive_s",
    "uptime/lost_s",
    "uptime/restarts",
    "uptime/pct",
    *(f"data/stat_{i}" for i in range(8)),
)
LOG_EVERY = 10
_COMPARE = (
    "import sys, hlat; from hlat.track.compare import main; rc = main(sys.argv[1:]); "
    "hwm = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')]; "
    "print('hlat_compare_peak_kib', hwm[0], hlat.__file__, file=sys.stderr); sys.exit(rc)"
)
"""``hlat compare`` in a process of its own that prints its peak RSS (``VmHWM``) and which hlat it ran."""


def interval_rows(first: int, last: int) -> Rows:
    """The trainer's rows of steps ``first..last``: the per-step metrics, the interval's on the last row."""
    rows: Rows = []
    for s in range(first, last + 1):
        loss = 2.0 + 8.0 / (1 + s / 1000) + (s % 13) / 100
        rows.append((s, dict(zip(PER_STEP, (loss, 1 + (s % 7) / 10, 3e-4, 0.0, 0.0, s // 997, 1.8), strict=True))))
    rows[-1][1].update({key: float(i + last % 100) for i, key in enumerate(INTERVAL)})
    return rows


def drive(uri: str, steps: int, *, after: bool, workdir: Path, checkpoint_every: int, scale_to: int) -> dict:
    """Log ``steps`` synthetic steps into a new run; returns its timings and counts.

    The lean store thins at the stride of a ``scale_to``-step run, so that the points a step match what is scaled to.
    """
    cfg = TrackerConfig(uri=uri, experiment="tracking-scale", flush_every_s=5.0, system_metrics=False)
    ml = MLflowTracker(cfg, "after" if after else "before", {})
    empty = _db_bytes(uri)  # the store before this run's points: a sqlite file's tables and indexes
    writer = None
    if after:
        writer = SeriesWriter(workdir / ("ckpt-" + ml.run_id), 0)
        writer.upload_with(lambda p: ml.client.log_artifact(ml.run_id, str(p), SERIES_DIR), ml.run_id)
        tracker = MultiTracker([writer, LeanTracker(ml, every=store_every(scale_to, LOG_EVERY))])
    else:
        tracker = MultiTracker([ml])
    calls, saves, points = [], [], 0
    start = time.perf_counter()
    for first in range(1, steps + 1, LOG_EVERY):
        rows = interval_rows(first, min(first + LOG_EVERY - 1, steps))
        points += sum(len(r) for _, r in rows)
        t0 = time.perf_counter()
        tracker.log_metrics(rows)
        calls.append(time.perf_counter() - t0)
        last = rows[-1][0]
        if writer is not None and last % checkpoint_every == 0:
            t0 = time.perf_counter()
            writer.checkpoint(last)
            saves.append(time.perf_counter() - t0)
    tracker.finish()
    wall = time.perf_counter() - start
    calls.sort()
    return {
        "run_id": ml.run_id,
        "points": points,
        "points_per_s": points / wall,
        "p50_ms": 1000 * calls[len(calls) // 2],
        "p99_ms": 1000 * calls[int(len(calls) * 0.99)],
        "save_ms": 1000 * statistics.median(saves) if saves else None,
        "empty_bytes": empty,
    }


def read_back(uri: str, result: dict, workdir: Path) -> None:
    """Add the history read, ``hlat compare`` and (a server) the UI chart endpoint times to ``result``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    t0 = time.perf_counter()
    result["loss_points"] = len(client.get_metric_history(result["run_id"], "train/loss"))
    result["history_s"] = time.perf_counter() - t0
    timed = run_compare(uri, [result["run_id"]], workdir / f"compare-{result['run_id']}", workdir)
    result["compare_s"], result["compare_mib"] = timed["wall_s"], timed["peak_mib"]
    if uri.startswith(("http://", "https://")):
        query = f"run_ids={result['run_id']}&metric_key=train/loss&max_results=320"
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"{uri}/ajax-api/2.0/mlflow/metrics/get-history-bulk-interval?{query}") as r:
            r.read()
        result["chart_s"] = time.perf_counter() - t0


def run_compare(uri: str, run_ids: list[str], out: Path, workdir: Path, src: Path | None = None) -> dict:
    """``hlat compare --runs <run_ids>`` in a process of its own: wall and CPU seconds, its peak RSS in MiB.

    ``src``: run the hlat of that ``src/`` directory (first on ``PYTHONPATH``) instead of the installed one.
    """
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", _COMPARE, "--uri", uri, "--runs", *run_ids, "--out", str(out)]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=workdir, env=env)
    wall = time.perf_counter() - t0
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, kib, ran = [line for line in done.stderr.splitlines() if line.startswith("hlat_compare_peak_kib")][-1].split()
    if src is not None and not Path(ran).resolve().is_relative_to(src.resolve()):
        raise RuntimeError(f"hlat compare ran {ran}, not the code under {src}")
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": int(kib) / 1024}


def sweep_runs(uri: str, first: str, n: int, steps: int, workdir: Path, checkpoint_every: int) -> list[str]:
    """``first`` and ``n - 1`` more runs of ``steps`` steps, each with a series of its own (module docstring)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_run(first).info.experiment_id
    ids = [first]
    for arm in range(1, n):
        run_id = client.create_run(experiment, run_name=f"arm {arm}").info.run_id
        client.log_batch(run_id, params=[Param("sweep.arm", str(arm))])
        writer = SeriesWriter(workdir / f"ckpt-{run_id}", 0)
        writer.upload_with(lambda p, run_id=run_id: client.log_artifact(run_id, str(p), SERIES_DIR), run_id)
        last: dict[str, tuple[int, float]] = {}
        for lo in range(1, steps + 1, LOG_EVERY):
            rows = interval_rows(lo, min(lo + LOG_EVERY - 1, steps))
            for step, row in rows:
                row["train/loss"] += 0.01 * arm
                last.update((key, (step, value)) for key, value in row.items())
            writer.log_metrics(rows)
            if rows[-1][0] % checkpoint_every == 0:
                writer.checkpoint(rows[-1][0])
        writer.finish()
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, (step, v) in last.items()])
        client.set_terminated(run_id)
        ids.append(run_id)
    return ids


def compare_runs(uri: str, ids: list[str], workdir: Path, baseline: Path | None, repeat: int) -> dict[str, dict]:
    """``hlat compare`` of the first run and of all ``ids``: per code and count, medians (peak: the largest).

    With ``baseline``, both codes run in turn and ``identical`` says whether their reports are equal byte for byte.
    """
    codes = {"baseline": baseline, "this tree": None} if baseline is not None else {"this tree": None}
    timed: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeat):
        for count in dict.fromkeys((1, len(ids))):
            for code, src in codes.items():
                out = workdir / f"compare-{code.replace(' ', '-')}-{count}"
                timed.setdefault((code, count), []).append(run_compare(uri, ids[:count], out, workdir, src))
    result: dict[str, dict] = {}
    for (code, count), runs in timed.items():
        result.setdefault(code, {})[count] = {
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "peak_mib": max(r["peak_mib"] for r in runs),
        }
    if baseline is not None:
        for count in dict.fromkeys((1, len(ids))):
            reports = [workdir / f"compare-{c}-{count}" for c in ("baseline", "this-tree")]
            same = all((reports[0] / f).read_bytes() == (reports[1] / f).read_bytes() for f in _REPORT)
            result["this tree"][count]["identical"] = same
    return result


_REPORT = ("comparison.md", "comparison.png")


def compare_table(result: dict[str, dict], steps: int) -> str:
    """The markdown table of :func:`compare_runs`."""
    codes = list(result)
    counts = list(result[codes[0]])
    lines = [
        f"`hlat compare --runs` of runs of {steps:,} steps: median wall / CPU (user + system), the largest peak RSS",
        "",
        f"| runs | {' | '.join(codes)} |" + (" this tree / baseline | reports identical |" if len(codes) > 1 else ""),
        f"|---|{'---:|' * len(codes)}" + ("---:|---|" if len(codes) > 1 else ""),
    ]
    for count in counts:
        cells = [
            f"{r[count]['wall_s']:.1f} s / {r[count]['cpu_s']:.1f} s, {r[count]['peak_mib']:.0f} MiB"
            for r in result.values()
        ]
        if len(codes) > 1:
            old, new = result[codes[0]][count], result[codes[1]][count]
            cells.append(" / ".join(f"{new[k] / old[k]:.2f}" for k in ("wall_s", "cpu_s", "peak_mib")))
            cells.append("yes" if new.get("identical") else "NO")
        lines.append(f"| {count} | {' | '.join(cells)} |")
    if len(counts) > 1:
        lo, hi = counts
        for code, r in result.items():
            per = {k: (r[hi][k] - r[lo][k]) / (hi - lo) for k in ("wall_s", "cpu_s", "peak_mib")}
            lines.append(
                f"\n{code}: each run beyond the first adds {per['wall_s']:.2f} s wall, {per['cpu_s']:.2f} s CPU, "
                f"{per['peak_mib']:.1f} MiB peak."
            )
    return "\n".join(lines)


def _db_bytes(uri: str) -> int | None:
    """The size of a sqlite store's file; None for a server."""
    return Path(uri.removeprefix("sqlite:///")).stat().st_size if uri.startswith("sqlite:") else None


def store_size(uri: str, workdir: Path, result: dict) -> None:
    """The run's growth of the sqlite file and its artifacts (``None`` for a server: measure its database there)."""
    size = _db_bytes(uri)
    result["db_bytes"] = None if size is None else size - result["empty_bytes"]
    runs = [d for d in (workdir / "mlruns").rglob(result["run_id"]) if d.is_dir()]
    result["artifact_bytes"] = sum(p.stat().st_size for d in runs for p in d.rglob("*") if p.is_file()) or None


def table(rows: dict[str, dict], steps: int, scale_to: int, uri: str) -> str:
    """The markdown report of both arms."""
    k = scale_to / steps
    size = "size of its sqlite file" if uri.startswith("sqlite:") else "not measured here (a server)"

    def mb(v: float | None) -> str:
        return "-" if v is None else f"{v * k / 1e6:,.0f} MB"

    lines = [
        f"{steps:,} steps into {uri.split('?')[0]}; store sizes and the history read x{k:g} (linear) for "
        f"{scale_to:,} steps; the rest as measured at {steps:,} steps.",
        "",
        f"| | {' | '.join(rows)} |",
        f"|---|{'---:|' * len(rows)}",
    ]
    spec = [
        ("points logged per step", lambda r: f"{r['points'] / steps:.2f}"),
        ("MLflow points per step", lambda r: f"{r['mlflow_points'] / steps:.2f}"),
        ("write throughput (points/s)", lambda r: f"{r['points_per_s']:,.0f}"),
        ("caller per log call p50 / p99", lambda r: f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f} ms"),
        ("series write per checkpoint (median)", lambda r: "-" if r["save_ms"] is None else f"{r['save_ms']:.0f} ms"),
        (f"MLflow store ({size}), scaled", lambda r: mb(r["db_bytes"])),
        ("artifacts (the Parquet series), scaled", lambda r: mb(r["artifact_bytes"])),
        ("get_metric_history('train/loss'), scaled", lambda r: f"{r['history_s'] * k:.1f} s"),
        (
            "hlat compare --runs <run>: wall, peak RSS (measured)",
            lambda r: f"{r['compare_s']:.1f} s, {r['compare_mib']:.0f} MiB",
        ),
    ]
    if any("chart_s" in r for r in rows.values()):
        spec.append(("UI chart endpoint (320 points)", lambda r: f"{r['chart_s']:.2f} s"))
    for name, cell in spec:
        lines.append(f"| {name} | {' | '.join(cell(r) for r in rows.values())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the arms, print the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=450_000, help="synthetic optimizer steps per arm (default 450,000)")
    ap.add_argument("--scale-to", type=int, default=450_000, help="extrapolate sizes and read times to this many")
    ap.add_argument("--uri", help="tracking URI (default: a fresh sqlite store per arm in a temporary directory)")
    ap.add_argument("--checkpoint-every", type=int, default=1000, help="steps between series parts (after)")
    ap.add_argument("--arms", nargs="+", default=["before", "after"], choices=["before", "after"])
    ap.add_argument("--compare-runs", type=int, default=16, help="hlat compare of 1 and of N runs (after; 1: only one)")
    ap.add_argument("--baseline-src", type=Path, help="the src/ of another checkout: hlat compare with it too")
    ap.add_argument("--repeat", type=int, default=3, help="times each hlat compare is timed (default 3)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hlat-tracking-scale-") as tmp:
        workdir = Path(tmp)
        os.chdir(workdir)  # a sqlite store's artifacts go to ./mlruns
        results = {}
        for arm in args.arms:
            uri = args.uri or f"sqlite:///{workdir / arm}.db"
            t0 = time.perf_counter()
            result = drive(
                uri,
                args.steps,
                after=arm == "after",
                workdir=workdir,
                checkpoint_every=args.checkpoint_every,
                scale_to=args.scale_to,
            )
            read_back(uri, result, workdir)
            store_size(uri, workdir, result)
            result["mlflow_points"] = _mlflow_points(uri, result["run_id"])
            results[arm] = result
            print(f"{arm}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(table(results, args.steps, args.scale_to, args.uri or "sqlite:///<fresh file per arm>"))
        if "after" in results:
            uri = args.uri or f"sqlite:///{workdir / 'after'}.db"
            t0 = time.perf_counter()
            ids = sweep_runs(
                uri, results["after"]["run_id"], args.compare_runs, args.steps, workdir, args.checkpoint_every
            )
            print(f"{len(ids) - 1} more runs: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            compared = compare_runs(uri, ids, workdir, args.baseline_src, args.repeat)
            print(f"\n{compare_table(compared, args.steps)}")
    return 0


def _mlflow_points(uri: str, run_id: str) -> int:
    """Points the run holds in MLflow (every key's history)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics
    if uri.startswith("sqlite:"):  # one query instead of reading every history back
        import sqlite3

        with sqlite3.connect(uri.removeprefix("sqlite:///")) as con:
            return con.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (run_id,)).fetchone()[0]
    return sum(len(client.get_metric_history(run_id, k)) for k in keys)


if __name__ == "__main__":
    sys.exit(main())
