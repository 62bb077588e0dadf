"""What MLflow's UI is given: experiments tagged for model training, the loss as a run's first metric, addresses in
the model-training view, and a sweep's parent run summarizing its arms (metrics, description, a saved view).

The UI itself, in a real browser: tests/integration/test_mlflow_ui.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hlat.config import TrackerConfig
from hlat.track import sweep_views, trackers
from hlat.track.runs import RunData
from hlat.track.trackers import EXPERIMENT_KIND_TAG, MODEL_TRAINING, MLflowTracker, experiment_id, ui_page
from tests.timeouts import hang_guard


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sqlite store for the module (making one takes seconds); every test uses names of its own in it."""
    return tmp_path_factory.mktemp("mlflow-ui")


def client(store: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{store / 'm.db'}")


def test_every_experiment_hlat_uses_is_tagged_for_model_training(store: Path) -> None:
    c = client(store)
    new = experiment_id(c, "new")
    assert c.get_experiment(new).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING == "custom_model_development"
    assert experiment_id(c, "new") == new
    old = c.create_experiment("old")  # made before hlat tagged experiments: tagged now
    assert experiment_id(c, "old") == old and c.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    chosen = c.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})  # a user's choice stays
    assert (
        experiment_id(c, "chosen") == chosen
        and c.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"
    )


def test_an_experiment_created_meanwhile_by_another_process_is_used(store: Path, monkeypatch) -> None:
    c = client(store)
    real_get, real_create = c.get_experiment_by_name, c.create_experiment
    calls = []

    def late_get(name):  # the first look finds nothing; another job creates it before this one does
        calls.append(name)
        return None if len(calls) == 1 else real_get(name)

    def create_twice(name, tags=None):
        real_create(name)
        return real_create(name, tags=tags)  # raises: it exists now

    monkeypatch.setattr(c, "get_experiment_by_name", late_get)
    monkeypatch.setattr(c, "create_experiment", create_twice)
    eid = experiment_id(c, "raced")
    assert real_get("raced").experiment_id == eid and c.get_experiment(eid).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


def test_the_tracker_creates_its_experiment_tagged_and_prints_a_model_training_address(store: Path) -> None:
    cfg = TrackerConfig(uri=f"sqlite:///{store}/m.db", experiment="exp", system_metrics=False)
    ml = MLflowTracker(cfg, "r", {})
    ml.finish()
    assert client(store).get_experiment(ml.experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert f"#/experiments/{ml.experiment_id}/runs/{ml.run_id}?workflowType=machine_learning" in ml.ui_hint()
    assert ui_page("3") == "#/experiments/3/runs?workflowType=machine_learning"
    assert ui_page("3", "abc", compareRunsMode="CHART").endswith(
        "/runs/abc?workflowType=machine_learning&compareRunsMode=CHART"
    )
    assert trackers.ui_address("http://h:5000/", "#/x") == "http://h:5000/#/x"


@pytest.fixture
def fast_system_metrics(monkeypatch) -> None:
    """System metrics sampled every 0.05 s, a mean logged every sample (MLflow's variables, which hlat honors)."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.05")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")


def first_metrics(store: Path, run_id: str) -> list[str]:
    """The run's metric keys in the order MLflow lists them (a sqlite store: the order they first came)."""
    return [m.key for m in client(store).get_run(run_id).data._metric_objs]


def system_steps(store: Path, run_id: str) -> list[int]:
    """The steps of the run's CPU utilization points (one of MLflow's system metrics), in the order they came."""
    return [m.step for m in client(store).get_metric_history(run_id, "system/cpu_utilization_percentage")]


def wait_for(what: str, done) -> None:
    deadline = time.monotonic() + hang_guard(120)
    while not done():
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def test_the_loss_is_a_runs_first_metric_and_system_metrics_start_after_it(store: Path, fast_system_metrics) -> None:
    """MLflow's compare view charts a run's first metric by default: not the pre-flight record, not system/."""
    cfg = TrackerConfig(uri=f"sqlite:///{store}/m.db", flush_every_s=0, system_metrics=True)
    ml = MLflowTracker(cfg, "r", {})
    ml.log_metrics([(0, {"preflight/passed": 1.0, "preflight/matmul_tflops": 2.0})])  # before the first step
    time.sleep(0.3)  # the background thread had its chance: the pre-flight row waits for the loss, no sampling yet
    assert first_metrics(store, ml.run_id) == [] and ml._system is None
    ml.log_metrics([(1, {"perf/tokens_per_s": 5.0, "train/loss": 9.0})])
    ml.log_metrics([(2, {"train/loss": 8.0, "perf/tokens_per_s": 6.0})])
    wait_for("system metrics", lambda: len(system_steps(store, ml.run_id)) >= 2)  # sampled, sent while it runs
    ml.finish()
    keys = first_metrics(store, ml.run_id)
    assert keys[0] == "train/loss" and set(keys) >= {"perf/tokens_per_s", "preflight/passed"}
    assert {"system/system_memory_usage_megabytes", "system/disk_usage_percentage"} <= set(keys)
    steps = system_steps(store, ml.run_id)
    assert steps == list(range(len(steps)))  # one mean per step, numbered from 0, the last one at the end
    history = client(store).get_metric_history(ml.run_id, "preflight/passed")
    assert [(m.step, m.value) for m in history] == [(0, 1.0)]  # held back, not changed


def test_a_run_without_a_loss_still_sends_everything_and_samples_nothing(store: Path) -> None:
    cfg = TrackerConfig(uri=f"sqlite:///{store}/m.db", flush_every_s=0, system_metrics=True)
    ml = MLflowTracker(cfg, "doctor", {})
    ml.log_metrics([(0, {"preflight/passed": 1.0})])
    ml.finish()
    assert first_metrics(store, ml.run_id) == ["preflight/passed"] and ml._system is None
    synced = MLflowTracker(cfg, "checkpoint before the first loss", {})
    synced.log_metrics([(0, {"preflight/passed": 1.0})])
    assert synced.sync() and first_metrics(store, synced.run_id) == ["preflight/passed"]  # a checkpoint: no hole
    synced.finish()


def test_a_continued_run_samples_at_once_and_numbers_its_system_metrics_on(store: Path, monkeypatch) -> None:
    cfg = TrackerConfig(uri=f"sqlite:///{store}/m.db", flush_every_s=0, system_metrics=True)
    first = MLflowTracker(cfg, "r", {})
    assert first._system is None
    # The defaults: a point per system metric every 5 min (the mean of 30-s samples): weeks fit the store.
    first.log_metrics([(1, {"train/loss": 9.0})])
    wait_for("the sampler", lambda: first._system is not None)
    assert first._system.interval_s * first._system.samples >= 300
    first.finish("KILLED")
    before = system_steps(store, first.run_id)
    assert before == [0]  # the mean of the samples taken before the end
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.05")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    again = MLflowTracker(cfg, "r", {}, run_id=first.run_id)
    assert again.run_id == first.run_id and again._system is not None  # no loss to wait for: MLflow has one
    again.log_metrics([(2, {"perf/tokens_per_s": 1.0})])
    wait_for("the continued run's system metrics", lambda: len(system_steps(store, first.run_id)) >= 3)
    again.finish()
    assert "perf/tokens_per_s" in first_metrics(store, first.run_id)
    steps = system_steps(store, first.run_id)
    assert steps == list(range(len(steps)))  # numbered on after the first attempt's: none twice, none dropped


def arm(name: str, losses: list[float], run_id: str | None = None, **params: str) -> RunData:
    series = [(step, v) for step, v in enumerate(losses, start=1)]
    return RunData(
        run_id=run_id or f"{name.replace('=', '')[:20]:0<32}",
        run_name=name,
        params=params,
        metrics={"train/loss": series},
        status="FINISHED",
    )


def test_arm_labels_are_valid_distinct_metric_key_parts() -> None:
    from mlflow.utils.validation import _validate_metric_name

    assert sweep_views.metric_label("optimizer.beta2=0.95,train.steps=6") == "optimizer.beta2_0.95 train.steps_6"
    assert sweep_views.metric_label("data=fineweb/edu, x=1") == "data_fineweb.edu x_1"
    runs = [arm("a=1", [1.0], run_id="1" * 32), arm("a=1", [1.0], run_id="2" * 32), arm("..", [1.0], run_id="3" * 32)]
    assert sweep_views.arm_labels(runs) == ["a_1 11111111", "a_1 22222222", "33333333"]
    for name in ("optimizer.lr=1e-3", "model=llama/7b,precision=bf16", "ü=ß é", "x" * 300, "a|b=[1,2]"):
        _validate_metric_name(f"train_loss/{sweep_views.metric_label(name)}")


def test_the_parent_run_metrics_summarize_every_arm() -> None:
    runs = [arm("lr=1", [5.0, 4.0, 3.0]), arm("lr=2", [5.0, 2.0, 2.5]), arm("lr=3", [])]
    got = {(k, step): v for k, v, step in sweep_views.summary_metrics(runs)}
    assert got[("final_loss/lr_1", 0)] == 3.0 and got[("min_loss/lr_1", 0)] == 3.0
    assert got[("final_loss/lr_2", 0)] == 2.5 and got[("min_loss/lr_2", 0)] == 2.0
    assert [got[("train_loss/lr_2", s)] for s in (1, 2, 3)] == [5.0, 2.0, 2.5]
    assert got[("sweep/best_final_loss", 0)] == 2.5
    assert not any("lr_3" in k for k, _ in got)  # an arm without a loss point has no summary
    long = sweep_views.thin([(s, float(s)) for s in range(10_001)])
    assert len(long) == sweep_views.HISTORY_POINTS and long[0] == (0, 0.0) and long[-1] == (10_000, 10_000.0)


def test_summarize_gives_the_parent_run_metrics_a_linked_description_and_a_saved_view(store: Path) -> None:
    c = client(store)
    eid = experiment_id(c, "sw")
    parent = c.create_run(eid, run_name="sweep 12-00-00", tags={"hlat.sweep_overrides": "optimizer.lr=1,2"})
    pid = parent.info.run_id
    runs = []
    for lr, losses in (("1", [5.0, 4.0]), ("2", [5.0, 3.0])):
        run = c.create_run(eid, run_name=f"optimizer.lr={lr}", tags={"mlflow.parentRunId": pid})
        runs.append(arm(f"optimizer.lr={lr}", losses, run_id=run.info.run_id, **{"optimizer.lr": lr}))
    page = sweep_views.summarize(c, pid, runs, "12-00-00")

    assert (
        page
        == f"#/experiments/{eid}/runs?workflowType=machine_learning&viewStateShareKey=hlat-{pid}&compareRunsMode=CHART"
    )
    data = c.get_run(pid).data
    assert data.metrics["sweep/best_final_loss"] == 3.0 and data.metrics["final_loss/optimizer.lr_2"] == 3.0
    colors = [c.get_run(r.run_id).data.tags["mlflow.runColor"] for r in runs]
    assert colors == ["#1f77b4", "#ff7f0e"]  # comparison.png's C0, C1
    note = data.tags["mlflow.note.content"]
    assert note.startswith("Hydra multirun optimizer.lr=1,2") and f"]({page})" in note
    assert note.index(f"(#/experiments/{eid}/runs/{runs[1].run_id}?") < note.index(runs[0].run_id)  # best first

    saved = json.loads(c.get_experiment(eid).tags[f"mlflow.sharedViewState.hlat-{pid}"])
    assert saved["name"] == "sweep 12-00-00" and isinstance(saved["createdAt"], int)
    state = json.loads(saved["state"])
    assert state["searchFilter"] == f"attributes.run_id IN ('{runs[0].run_id}', '{runs[1].run_id}')"
    assert c.search_runs([eid], state["searchFilter"], max_results=10)  # MLflow accepts the filter
    assert state["selectedColumns"] == ["params.`optimizer.lr`", "metrics.`train/loss`"]
    line, parallel, bar = state["compareRunCharts"]
    assert (line["type"], line["metricKey"]) == ("LINE", "train/loss")
    assert (parallel["selectedParams"], parallel["selectedMetrics"]) == (["optimizer.lr"], ["train/loss"])
    assert bar["type"] == "BAR" and {c["metricSectionId"] for c in state["compareRunCharts"]} == {
        state["compareRunSections"][0]["uuid"]
    }
