"""hlat.track.compare: run selection from a real sqlite MLflow store, the comparison table, the report files, CLI."""

from __future__ import annotations

import itertools
import math
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hlat.track import compare, run_store, sweep_views
from hlat.track.compare import RunData, differing_keys, select_runs, summary_table, write_report
from hlat.track.run_store import ClientRuns, SqliteRuns, StoredRun, open_runs
from hlat.track.runs import Points
from hlat.track.series import SERIES_DIR, SeriesWriter

STEPS = list(range(1, 21))  # 20 logged points: the last 10% are steps 19 and 20
SWEEP = "multirun/2026-01-01/00-00-00"


@dataclass
class Store:
    uri: str
    root: Path  # the directory holding mlflow.db and the fake multirun tree
    ids: dict[str, str]  # run name -> run id


def _loss(offset: float) -> list[float]:
    return [5.0 - 0.1 * s + offset for s in STEPS]  # ends ..., 3.1 + offset, 3.0 + offset


def _make_run(
    client,
    exp_id: str,
    name: str,
    *,
    start: int,
    params: dict[str, str],
    metrics: dict[str, list],
    run_dir: str | None,
    finish: bool = True,
) -> str:
    from mlflow.entities import Metric, Param

    tags = {"run_dir": run_dir} if run_dir else {}
    run_id = client.create_run(exp_id, start_time=start, run_name=name, tags=tags).info.run_id
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    points = [Metric(key, float(v), 1_000 + step, step) for key, series in metrics.items() for step, v in series]
    client.log_batch(run_id, metrics=points[::-1])  # logged newest first: select_runs must sort by step
    if finish:
        client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """One experiment of three finished runs differing in precision, one crashed run, and decoys elsewhere."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ablation")
    other = client.create_experiment("other", artifact_location=str(root / "artifacts"))  # odd's series go there
    client.create_experiment("empty")

    def params(i: int, precision: str, total: int) -> dict[str, str]:
        return {
            "model.name": "tiny",
            "optimizer.beta2": "0.95",
            "precision.name": precision,
            "memory.bytes_per_param.total": str(total),
            # per-run noise that differing_keys must ignore
            "tracker.run_name": precision,
            "train.checkpoint_dir": f"/ckpt/{i}",
            "train.resume": str(i),
            "hydra.job.num": str(i),
        }

    grad = [(s, float(s)) for s in STEPS]  # second half 11..20: median 15.5
    ids = {
        "fp32": _make_run(
            client,
            exp,
            "fp32",
            start=1_000,
            params=params(0, "fp32", 16),
            run_dir=f"{root}/{SWEEP}/0",
            metrics={
                "train/loss": list(zip(STEPS, _loss(0.0), strict=True)),
                "train/grad_norm": grad,
                "train/lr": [(s, 1e-3) for s in STEPS],
                "train/param_norm": [(5, 40.0), (10, 41.0), (15, 41.5), (20, 42.0)],
                "perf/tokens_per_s": [(s, 1000.0 * s) for s in STEPS],  # median 10,500
                "perf/step_time_s": [(s, 0.5) for s in STEPS],
            },
        ),
        "bf16": _make_run(
            client,
            exp,
            "bf16",
            start=2_000,
            params=params(1, "bf16", 8),
            run_dir=f"{root}/{SWEEP}/1",
            metrics={
                "train/loss": list(zip(STEPS, _loss(0.5), strict=True)),
                "train/grad_norm": [(s, 2.0 * v) for s, v in grad],  # median 31
                "train/param_norm": [(10, 30.0), (20, 31.25)],
                "perf/tokens_per_s": [(1, 100.0), (2, 300.0), (3, 200.0)],  # median 200
            },
        ),
        # no param norm and no throughput logged: those cells must read "-"
        "bf16_sr": _make_run(
            client,
            exp,
            "bf16_sr",
            start=3_000,
            run_dir=f"{root}/{SWEEP}/2",
            params={**params(2, "bf16_sr", 8), "precision.stochastic_rounding": "True"},
            metrics={"train/loss": list(zip(STEPS, _loss(0.25), strict=True)), "train/grad_norm": grad},
        ),
        "crashed": _make_run(
            client,
            exp,
            "crashed",
            start=4_000,
            params=params(3, "bf16", 8),
            run_dir=f"{root}/{SWEEP}/3",
            metrics={"train/loss": [(1, 9.0)]},
            finish=False,
        ),
        # in another experiment, its directory a string prefix of the sweep's but not inside it
        "decoy": _make_run(
            client,
            other,
            "decoy",
            start=5_000,
            params=params(4, "fp32", 16),
            run_dir=f"{root}/{SWEEP}-b/0",
            metrics={"train/loss": [(1, 1.0)]},
        ),
    }
    _odd_runs(client, exp, other, root, ids)
    return Store(uri=uri, root=root, ids=ids)


def _odd_runs(client, exp_id: str, other_id: str, root: Path, ids: dict[str, str]) -> None:
    """What only the store reader's tests read: a deleted run, a deleted experiment, and beside the decoy a run with
    NaN, infinite and twice-logged points, started when the decoy was, with a series logged as artifacts."""
    from mlflow.entities import Metric

    ids["deleted"] = _make_run(client, exp_id, "deleted", start=6_000, params={}, metrics={}, run_dir=None)
    client.delete_run(ids["deleted"])
    client.delete_experiment(client.create_experiment("gone"))
    ids["odd"] = _make_run(client, other_id, "odd", start=5_000, params={"k": "v"}, metrics={}, run_dir=None)
    points = [("loss", 3.0, 10, 1), ("loss", 2.0, 11, 2), ("loss", 9.0, 12, 1), ("loss", 8.0, 12, 1)]
    points += [("gn", float("nan"), 10, 1), ("gn", float("inf"), 11, 2), ("low", float("-inf"), 10, 1)]
    points += [("nan", float("nan"), 10, 3)]
    client.log_batch(ids["odd"], metrics=[Metric(k, v, t, s) for k, v, t, s in points])
    writer = SeriesWriter(root / "ckpt", 0)
    writer.upload_with(lambda p: client.log_artifact(ids["odd"], str(p), SERIES_DIR), ids["odd"])
    writer.log_metrics([(s, {"train/loss": 1.0 / s}) for s in range(1, 9)])
    writer.checkpoint(4)
    writer.finish()


def names(runs: list[RunData]) -> list[str]:
    return [r.run_name for r in runs]


def table_rows(table: str) -> list[list[str]]:
    """The cells of a Markdown table: header first, separator line dropped."""
    lines = table.splitlines()
    assert set(lines[1]) <= set("|-:"), lines[1]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in [lines[0], *lines[2:]]]


# --------------------------------------------------------------------------------------------------- selection


def test_select_by_experiment_reads_finished_runs_oldest_first(store: Store) -> None:
    runs = select_runs(store.uri, experiment="ablation")
    assert names(runs) == ["fp32", "bf16", "bf16_sr"]
    fp32 = runs[0]
    assert fp32.run_id == store.ids["fp32"] and fp32.status == "FINISHED"
    assert fp32.params["precision.name"] == "fp32" and fp32.params["model.name"] == "tiny"
    assert set(fp32.metrics) == set(compare.METRIC_KEYS)
    assert [s for s, _ in fp32.metrics["train/loss"]] == STEPS  # sorted although logged newest first
    assert fp32.metrics["train/loss"][-1] == (20, pytest.approx(3.0))
    assert fp32.metrics["train/param_norm"] == [(5, 40.0), (10, 41.0), (15, 41.5), (20, 42.0)]
    assert runs[2].metrics["train/param_norm"] == [] and runs[2].metrics["perf/tokens_per_s"] == []
    assert fp32.run_dir == f"{store.root}/{SWEEP}/0"


def test_select_all_statuses_includes_the_unfinished_run(store: Store) -> None:
    runs = select_runs(store.uri, experiment="ablation", status=None)
    assert names(runs) == ["fp32", "bf16", "bf16_sr", "crashed"]
    assert runs[-1].status == "RUNNING"


def test_select_by_run_ids_keeps_the_given_order(store: Store) -> None:
    ids = store.ids
    runs = select_runs(store.uri, run_ids=[ids["bf16_sr"], ids["decoy"], ids["fp32"], ids["bf16_sr"]])
    assert names(runs) == ["bf16_sr", "decoy", "fp32"]


def test_select_by_run_id_refuses_an_unfinished_run_unless_asked(store: Store) -> None:
    with pytest.raises(ValueError, match=rf"{store.ids['crashed']} is RUNNING.*--all-statuses"):
        select_runs(store.uri, run_ids=[store.ids["fp32"], store.ids["crashed"]])
    runs = select_runs(store.uri, run_ids=[store.ids["crashed"]], status=None)
    assert names(runs) == ["crashed"]


def test_select_by_sweep_dir_matches_whole_path_components(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = select_runs(store.uri, sweep_dir=str(store.root / SWEEP))
    assert names(runs) == ["fp32", "bf16", "bf16_sr"]  # not the decoy in .../00-00-00-b
    monkeypatch.chdir(store.root)
    relative = select_runs(store.uri, sweep_dir=SWEEP + "/", status=None)
    assert names(relative) == ["fp32", "bf16", "bf16_sr", "crashed"]
    assert names(select_runs(store.uri, sweep_dir=f"{SWEEP}-b")) == ["decoy"]
    assert names(select_runs(store.uri, sweep_dir=f"{SWEEP}/1")) == ["bf16"]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({}, r"exactly one of experiment=, run_ids= or sweep_dir=.*none was given"),
        ({"experiment": "ablation", "sweep_dir": "x"}, r"exactly one of .*got experiment and sweep_dir"),
        ({"experiment": "a", "run_ids": ["b"], "sweep_dir": "c"}, r"got experiment and run_ids and sweep_dir"),
        ({"run_ids": []}, r"run_ids is empty"),
        ({"experiment": "ablation", "status": "DONE"}, r"unknown run status 'DONE'"),
    ],
)
def test_select_argument_errors(store: Store, kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        select_runs(store.uri, **kwargs)


def test_select_errors_name_what_was_not_found_and_where(store: Store, tmp_path: Path) -> None:
    uri = store.uri
    with pytest.raises(ValueError, match=r"no MLflow experiment 'nope' at sqlite:///.*ablation, empty, other"):
        select_runs(uri, experiment="nope")
    with pytest.raises(ValueError, match=r"experiment 'empty' at sqlite:///\S+ has no runs"):
        select_runs(uri, experiment="empty")
    with pytest.raises(ValueError, match=rf"no MLflow run with id 0123abcd at {uri}"):
        select_runs(uri, run_ids=[store.ids["fp32"], "0123abcd"])
    with pytest.raises(ValueError, match=rf"no MLflow run at {uri} has its run_dir tag under .*elsewhere"):
        select_runs(uri, sweep_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=rf"none of the 1 runs under .*{SWEEP}/3 at {uri} is FINISHED"):
        select_runs(uri, sweep_dir=str(store.root / SWEEP / "3"))
    missing = tmp_path / "missing.db"
    with pytest.raises(ValueError, match=r"no MLflow store at sqlite:///.*missing\.db.*--uri"):
        select_runs(f"sqlite:///{missing}", experiment="ablation")
    assert not missing.exists()  # and none was created on the way


# --------------------------------------------------------------------------------------------------- analysis


def run(name: str, params: dict[str, str], **metrics: list[tuple[int, float]]) -> RunData:
    return RunData(run_id=f"{name:0<32}", run_name=name, params=params, metrics=metrics)


def test_differing_keys_ignores_per_run_noise() -> None:
    a = run(
        "a",
        {
            "precision.name": "fp32",
            "model.name": "tiny",
            "hydra.job.num": "0",
            "tracker.run_name": "a",
            "train.checkpoint_dir": "/c/0",
            "train.resume": "False",
            "only.in.a": "1",
        },
    )
    b = run(
        "b",
        {
            "precision.name": "bf16",
            "model.name": "tiny",
            "hydra.job.num": "1",
            "tracker.run_name": "b",
            "train.checkpoint_dir": "/c/1",
            "train.resume": "True",
        },
    )
    assert differing_keys([a, b]) == ["only.in.a", "precision.name"]
    assert differing_keys([a]) == []
    assert differing_keys([a, a]) == []


def test_differing_keys_of_the_stored_runs(store: Store) -> None:
    runs = select_runs(store.uri, experiment="ablation")
    assert differing_keys(runs) == [
        "memory.bytes_per_param.total",
        "precision.name",
        "precision.stochastic_rounding",
    ]


def test_summary_table_values(store: Store) -> None:
    runs = select_runs(store.uri, experiment="ablation")
    header, *rows = table_rows(summary_table(runs))
    assert header == [  # the precision fields and memory figures are folded into precision.name
        "run",
        "run id",
        "precision.name",
        "final loss (last 10%)",
        "min loss",
        "grad norm median (2nd half)",
        "param norm (end)",
        "tokens/s (median)",
    ]
    assert rows == [
        ["fp32", f"`{store.ids['fp32'][:8]}`", "fp32", "3.0500", "3.0000", "15.500", "42.00", "10,500"],
        ["bf16", f"`{store.ids['bf16'][:8]}`", "bf16", "3.5500", "3.5000", "31.000", "31.25", "200"],
        ["bf16_sr", f"`{store.ids['bf16_sr'][:8]}`", "bf16_sr", "3.3000", "3.2500", "15.500", "-", "-"],
    ]


def test_keys_a_preset_name_explains_are_folded_into_it() -> None:
    runs = [
        run("a", {"precision.name": "bf16_sr", "precision.stochastic_rounding": "True", "optimizer.beta2": "0.95"}),
        run("b", {"precision.name": "bf16_sr", "precision.stochastic_rounding": "True", "optimizer.beta2": "0.99"}),
        run("c", {"precision.name": "bf16", "precision.stochastic_rounding": "False", "optimizer.beta2": "0.95"}),
    ]
    assert compare.differing_keys(runs) == ["optimizer.beta2", "precision.name", "precision.stochastic_rounding"]
    assert compare.shown_keys(runs) == ["optimizer.beta2", "precision.name"]  # beta2 varies within bf16_sr: kept
    runs[1].params["precision.stochastic_rounding"] = "False"  # now not a function of the preset: shown
    assert compare.shown_keys(runs) == compare.differing_keys(runs)


def test_summary_statistics_edge_cases() -> None:
    short = run("short", {}, **{"train/loss": [(1, 4.0), (2, float("nan")), (3, 2.0)], "train/grad_norm": [(1, 7.0)]})
    assert compare.final_loss(short) == 2.0  # fewer than 10 points: the last one
    assert compare.min_loss(short) == 2.0  # NaN ignored
    assert compare.grad_norm_median(short) == 7.0
    empty = run("empty", {"x": "1"})
    assert compare.final_loss(empty) is None and compare.last_param_norm(empty) is None
    header, row = table_rows(summary_table([empty]))
    assert header[:2] == ["run", "run id"] and len(header) == 7  # one run: no differing keys
    assert row[2:] == ["-"] * 5
    piped = run("a|b", {"k": "x|y"})
    assert "a\\|b" in summary_table([piped, run("c", {"k": "z"})])


def test_label_names_the_differing_values() -> None:
    a = run("a", {"precision.name": "fp32", "optimizer.beta2": "0.95"})
    assert compare.label(a, ["optimizer.beta2", "precision.name"]) == "a (optimizer.beta2=0.95, precision.name=fp32)"
    assert compare.label(a, []) == "a"
    swept = run("optimizer.beta2=0.95,train.seed=2", a.params)  # a sweep job: named by its overrides
    assert compare.label(swept, ["optimizer.beta2", "precision.name"]) == f"{swept.run_name} (precision.name=fp32)"
    assert compare.label(swept, ["optimizer.beta2"]) == swept.run_name


# --------------------------------------------------------------------------------------------------- report and CLI


def test_write_report(store: Store, tmp_path: Path) -> None:
    runs = select_runs(store.uri, experiment="ablation")
    out = tmp_path / "nested" / "report"
    md, png = write_report(runs, out)
    assert (md, png) == (out / "comparison.md", out / "comparison.png")
    text = md.read_text()
    assert text.startswith("# Comparison of 3 MLflow runs\n")
    assert summary_table(runs) in text
    assert "](comparison.png)" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def long_run(name: str, seed: int, n: int = 6_000) -> RunData:
    """A run of ``n`` logged steps with one-step spikes, as a long run's series reads back."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1) * 3  # logged every 3 steps
    loss = 3 + rng.standard_normal(n) / 10
    loss[[777, 4_321]] = [60.0, -9.0]
    gn = np.exp(rng.standard_normal(n))
    gn[[5, 5_000]] = [1e4, 1e-5]
    tps = rng.uniform(900, 1100, n // 10)
    metrics = {"train/loss": Points(steps, loss), "train/grad_norm": Points(steps, gn)}
    metrics |= {"perf/tokens_per_s": Points(steps[::10], tps), "train/param_norm": Points(steps[::10], tps / 7)}
    return RunData(run_id=f"{name:0<32}", run_name=name, params={"seed": str(seed)}, metrics=metrics)


def test_a_long_run_is_plotted_as_each_buckets_lowest_and_highest_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot draws 1000 step ranges of each line by their lowest and highest point (so a one-step spike shows),
    at their own steps; runs reduced to their digest as they are read draw the same image and table, byte for byte."""
    from matplotlib.figure import Figure

    full = [long_run("a", 0), long_run("b", 1)]
    reduced = [compare.digested(long_run("a", 0)), compare.digested(long_run("b", 1))]
    assert all(r.metrics == {} and r.digest is not None for r in reduced)
    assert summary_table(reduced) == summary_table(full)
    assert sweep_views.summary_metrics(reduced) == sweep_views.summary_metrics(full)
    figures: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kw: (figures.append(self), save(self, *args, **kw)))
    compare.plot(full, tmp_path / "full.png")
    assert compare.plot(reduced, tmp_path / "reduced.png").read_bytes() == (tmp_path / "full.png").read_bytes()

    ax_loss, ax_gn = figures[0].axes[:2]
    loss, gn = full[0].series("train/loss"), full[0].series("train/grad_norm")
    total = np.cumsum(np.concatenate([[0.0], loss.values]))
    at = np.arange(len(loss))
    smooth = (total[at + 1] - total[np.maximum(at - 4, 0)]) / np.minimum(at + 1, 5)  # trailing mean of 5 logs
    for ax, (steps, values) in ((ax_loss, (loss.steps, smooth)), (ax_gn, (gn.steps, gn.values))):
        xs, ys = ax.lines[0].get_data()
        assert len(xs) <= 2000 and (np.diff(xs) > 0).all()
        at = np.searchsorted(steps, xs)
        assert (steps[at] == xs).all() and np.allclose(ys, values[at])  # real points, at their own steps
        edges = np.linspace(0, len(steps), 1001).astype(int)
        extremes = {lo + int(f(values[lo:hi])) for lo, hi in itertools.pairwise(edges) for f in (np.argmin, np.argmax)}
        assert extremes <= set(at.tolist())
    assert max(ax_gn.lines[0].get_ydata()) == 1e4 and min(ax_gn.lines[0].get_ydata()) == 1e-5


def test_plot_copes_with_runs_that_logged_nothing(tmp_path: Path) -> None:
    path = compare.plot([run("empty", {}), run("one", {}, **{"train/loss": [(1, 3.0)]})], tmp_path / "p.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_main_writes_the_report(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    assert compare.main(["--uri", store.uri, "--sweep", str(store.root / SWEEP), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| fp32 |" in stdout and "3.0500" in stdout and str(out / "comparison.md") in stdout
    assert (out / "comparison.png").stat().st_size > 0
    assert "Comparison of 3 MLflow runs: sweep" in (out / "comparison.md").read_text()


def test_main_all_statuses(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--uri", store.uri, "--runs", store.ids["crashed"], "--out", str(tmp_path)]
    assert compare.main(argv) == 2
    assert "RUNNING" in capsys.readouterr().err
    assert compare.main([*argv, "--all-statuses"]) == 0
    assert "| crashed |" in capsys.readouterr().out


def test_main_unknown_experiment_returns_2(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--uri", store.uri, "--experiment", "nope", "--out", str(tmp_path / "x")]) == 2
    captured = capsys.readouterr()
    said, error = captured.err.splitlines()[:2]
    assert said == f"hlat compare: MLflow store {store.uri} (from --uri)"
    assert error.startswith(f"hlat compare: no MLflow experiment 'nope' at {store.uri}")
    assert captured.out == ""
    assert not (tmp_path / "x").exists()


def test_main_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main(["--experiment", "a", "--sweep", "b"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        compare.main([])
    assert (
        e.value.code == 2 and "one of the arguments --experiment --runs --sweep is required" in capsys.readouterr().err
    )


def test_peak_memory_column_appears_when_logged_and_prefers_cuda() -> None:
    cpu = run("cpu", {"k": "a"}, **{"sys/peak_rss_gib": [(1, 1.5), (2, 2.25)]})
    gpu = run("gpu", {"k": "b"}, **{"sys/peak_rss_gib": [(1, 9.0)], "sys/cuda_max_allocated_gib": [(1, 3.0), (2, 4.0)]})
    header, *rows = table_rows(summary_table([cpu, gpu]))
    assert header[-1] == "peak memory GiB (rank 0)"
    assert [r[-1] for r in rows] == ["2.25", "4.00"]
    assert "peak memory" not in summary_table([run("x", {"k": "a"}), run("y", {"k": "b"})])
    assert "fault.name" not in compare.differing_keys(
        [run("a", {"fault.name": "kill"}), run("b", {"fault.name": "none"})]
    )


def test_main_writes_into_the_sweep_and_finds_its_newest(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hlat compare --sweep multirun` (no --out) reads the newest sweep below it and writes into that sweep's folder,
    never into ./comparison of the working directory."""
    sweep = store.root / SWEEP
    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    older = store.root / "multirun" / "2025-01-01" / "00-00-00"  # a sweep of no runs, older than the real one
    older.mkdir(parents=True)
    (older / "multirun.yaml").write_text("hydra: {}\n")
    os.utime(older / "multirun.yaml", (1, 1))
    monkeypatch.chdir(tmp_path)
    assert compare.main(["--uri", store.uri, "--sweep", str(store.root / "multirun")]) == 0
    captured = capsys.readouterr()
    assert f"the newest sweep under {store.root / 'multirun'}: {sweep}" in captured.err
    assert (sweep / "comparison.md").is_file() and (sweep / "comparison.png").is_file()
    assert not (tmp_path / "comparison").exists()
    assert compare.main(["--uri", store.uri, "--sweep", str(older)]) == 2  # a sweep dir is taken as it is


def test_the_goodput_ledger_is_shown_from_each_runs_latest_values(tmp_path: Path) -> None:
    """The report's ledger table reads the job's totals at the run's last step (an earlier interval's are stale)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ledger")
    early = {"goodput/wall_s": [(10, 50.0)], "goodput/productive_s": [(10, 40.0)], "goodput/ettr": [(10, 0.8)]}
    final = {
        "goodput/wall_s": [(20, 7200.0)],
        "goodput/productive_s": [(20, 5400.0)],
        "goodput/replayed_s": [(20, 90.0)],
        "goodput/gap_s": [(20, 1710.0)],
        "goodput/attempts": [(20, 3.0)],
        "goodput/ettr": [(20, 0.75)],
    }
    ledger = {k: early.get(k, []) + v for k, v in final.items()}
    _make_run(client, exp, "long", start=1, params={"a": "1"}, metrics=ledger, run_dir=None)
    _make_run(client, exp, "older", start=2, params={"a": "2"}, metrics={"train/loss": [(1, 2.0)]}, run_dir=None)
    runs = select_runs(uri, experiment="ledger")
    rows = table_rows(compare.goodput_table(runs) or "")
    assert rows[0][:4] == ["run", "run id", "attempts", "wall"] and rows[0][-1] == "ETTR %"
    assert len(rows) == 2  # the run without a ledger has no row
    cell = dict(zip(rows[0], rows[1], strict=True))
    assert (cell["attempts"], cell["wall"], cell["productive"]) == ("3", "2.0 h", "90.0 min")
    assert (cell["replayed"], cell["gap"], cell["save"], cell["ETTR %"]) == ("90.0 s", "28.5 min", "0.0 s", "75.0")
    md, _ = write_report(runs, tmp_path / "report")
    assert compare.goodput_table(runs) in md.read_text()
    assert compare.goodput_table(runs[1:]) is None


# --------------------------------------------------------------------------------------------------- store reader


def comparable(value: object) -> object:
    """``value`` with NaN made comparable (NaN != NaN) and runs as dicts."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, StoredRun):
        value = vars(value)
    if isinstance(value, Points):
        value = list(value)
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return value


def test_the_sqlite_reader_answers_as_mlflow_does(store: Store) -> None:
    """hlat.track.run_store reads a sqlite store in MLflow's schema without mlflow: every question runs.py asks gets
    MLflow's own answer (a schema change of a new MLflow fails here)."""
    lite, mlflow = open_runs(store.uri), ClientRuns.open(store.uri)
    assert isinstance(lite, SqliteRuns)
    for name in ("ablation", "gone", "empty", "nope"):
        assert lite.experiment_id(name) == mlflow.experiment_id(name), name
    assert sorted(lite.experiment_names()) == sorted(mlflow.experiment_names())
    assert sorted(lite.experiment_ids()) == sorted(mlflow.experiment_ids())
    experiments = [lite.experiment_id(name) or "" for name in ("ablation", "other")]
    for status in (None, "FINISHED", "RUNNING", "KILLED"):
        got = [lite.details(r) for r in lite.search(experiments, status)]
        assert comparable(got) == comparable(mlflow.search(experiments, status)), status
    tie = sorted(("decoy", "odd"), key=store.ids.__getitem__)  # started at once: MLflow orders by run id
    assert [r.run_name for r in lite.search(experiments, None)][-2:] == tie
    for run_id in [*store.ids.values(), "0" * 32]:
        run = lite.get(run_id)
        assert comparable(run and lite.details(run)) == comparable(mlflow.get(run_id)), run_id
        for key in ("train/loss", "loss", "gn", "low", "nan", "none") if run else ():
            assert comparable(lite.history(run_id, key)) == comparable(mlflow.history(run_id, key)), (run_id, key)
    assert lite.history(store.ids["odd"], "loss") == [(1, 9.0), (2, 2.0)]  # the latest; on a tie, the larger value
    odd = lite.get(store.ids["odd"])
    assert odd is not None
    names = lite.series_names(odd)
    assert names == sorted(a.path for a in mlflow.client.list_artifacts(odd.run_id, SERIES_DIR)) and len(names) == 3
    with lite.series_files(odd, names) as paths, mlflow.series_files(odd, names) as theirs:
        assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in theirs]
    lite.close()


def test_select_runs_reads_the_same_through_mlflows_client(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    selections = [
        {"experiment": "ablation", "status": None},
        {"run_ids": [store.ids["odd"], store.ids["fp32"], store.ids["deleted"]], "status": None},
        {"sweep_dir": str(store.root / SWEEP)},
    ]
    lite = [select_runs(store.uri, **kwargs) for kwargs in selections]
    monkeypatch.setattr(run_store, "_sqlite_path", lambda uri: None)  # what a server's store goes through
    for kwargs, runs in zip(selections, lite, strict=True):
        theirs = select_runs(store.uri, **kwargs)
        assert comparable([vars(r) for r in runs]) == comparable([vars(r) for r in theirs]), kwargs
    assert lite[1][0].series("train/loss") == [(s, 1.0 / s) for s in range(1, 9)]  # odd's series, from its artifacts


def test_stores_the_sqlite_reader_does_not_know_go_to_mlflow(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ClientRuns, "open", classmethod(lambda cls, uri: f"MLflow's client on {uri}"))
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as con:
        con.execute("CREATE TABLE runs (run_uuid TEXT)")
    for uri in (f"sqlite:///{foreign}", f"{store.uri}?timeout=5", f"sqlite:///{tmp_path / 'missing.db'}"):
        assert open_runs(uri) == f"MLflow's client on {uri}"  # connection options: SQLAlchemy's to read
    tenants = tmp_path / "tenants.db"
    tenants.write_bytes(Path(store.uri.removeprefix("sqlite:///")).read_bytes())
    with sqlite3.connect(tenants) as con:
        con.execute("UPDATE experiments SET workspace = 'team-b' WHERE name = 'empty'")
    assert open_runs(f"sqlite:///{tenants}") == f"MLflow's client on sqlite:///{tenants}"  # MLflow's workspaces
    assert isinstance(open_runs(store.uri), SqliteRuns)


def test_compare_of_a_sqlite_store_imports_neither_mlflow_nor_pandas(store: Store, tmp_path: Path) -> None:
    """What keeps ``hlat compare`` small (docs/performance.md): importing it loads neither mlflow nor matplotlib, and
    comparing runs of a sqlite store never mlflow (~170 MiB with its store), nor pandas (which pyarrow's
    ``to_numpy`` imports: ~50 MiB), nor SQLAlchemy."""
    code = (
        "import sys; from hlat.track.compare import main; "
        "print(sorted(m for m in ('mlflow', 'matplotlib') if m in sys.modules)); rc = main(sys.argv[1:]); "
        "print(sorted(m for m in ('mlflow', 'pandas', 'sqlalchemy') if m in sys.modules)); sys.exit(rc)"
    )
    argv = ["--uri", store.uri, "--runs", store.ids["odd"], store.ids["fp32"], "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True, env=env)
    lines = done.stdout.splitlines()
    assert lines[0] == "[]" and lines[-1] == "[]", done.stdout
    assert "| odd |" in done.stdout and "| fp32 |" in done.stdout and (tmp_path / "comparison.png").is_file()
