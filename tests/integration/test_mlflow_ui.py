"""MLflow's UI (3.17) over a finished sweep, as a person sees it in a browser (headless Chromium, Playwright).

One tiny sweep (two arms, real training, system metrics on), ``mlflow server`` over its store, then the pages hlat's
output points at. Without chromium or the playwright package the tests skip; under CI (``CI`` set) they fail.

What the UI does by itself, and why hlat's addresses carry ``?workflowType=machine_learning``: MLflow 3.17 opens every
experiment in its GenAI mode (a traces dashboard) until the user flips its "GenAI / Model training" switch; it
ignores the experiment's ``mlflow.experimentKind`` tag (hlat sets it anyway: older 3.x UIs read it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlparse

import pytest

from hlat.track.trackers import ui_page
from tests.integration.mlflow_ui import (
    ROOT,
    MlflowServer,
    Sweep,
    browser_missing,
    browser_page,
    init_store,
    open_page,
    run_sweep,
)
from tests.integration.mlflow_ui import TINY as TINY_OVERRIDES
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
ARMS = ("optimizer.lr=0.001", "optimizer.lr=0.003")


@pytest.fixture(scope="module")
def browser_ok() -> None:
    why = browser_missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must drive a browser: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def ui(browser_ok, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[tuple[Sweep, str]]:
    """The sweep and the address of a server over its store (started while the sweep trains)."""
    work = tmp_path_factory.mktemp("mlflow-ui")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    init_store(uri)
    server = MlflowServer(uri, work).start()
    try:
        sweep = run_sweep(work, cache_dir, "train.steps=16", "optimizer.lr=1e-3,3e-3")
        yield sweep, server.wait()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(ui) -> Iterator[Any]:
    with browser_page() as p:
        yield p


def test_the_addresses_hlat_prints_open_the_training_runs(ui, page) -> None:
    sweep, base = ui
    assert set(sweep.arms) == set(ARMS)
    text = open_page(page, f"{base}/{ui_page(sweep.experiment_id)}", f"sweep {sweep.dir.name}", "matching runs")
    assert "/runs" in page.url and "Model training" in text
    assert "No data available for the selected time range" not in text  # not the GenAI traces dashboard
    arm = sweep.arms[ARMS[0]]
    printed = f"http://127.0.0.1:5000/#/experiments/{sweep.experiment_id}/runs/{arm}?workflowType=machine_learning"
    assert printed in sweep.stdout  # each job's "MLflow run ... Open it with: ..." line
    # The parent run's name comes with a request of its own, after "Parent run": wait for it too, not only on a
    # quiet machine (under load the page was read before it came).
    text = open_page(
        page, printed.replace("http://127.0.0.1:5000", base), "Parent run", ARMS[0], f"sweep {sweep.dir.name}"
    )
    assert f"sweep {sweep.dir.name}" in text and "train/loss" in text


def test_the_parent_run_links_its_arms_and_carries_their_losses(ui, page) -> None:
    sweep, base = ui
    text = open_page(page, f"{base}/{ui_page(sweep.experiment_id, sweep.parent_run_id)}", "Child runs", *ARMS)
    for name, run_id in sweep.arms.items():
        links = page.locator(f'a[href*="/runs/{run_id}"]')
        # under "Child runs" and in the description's table
        links.nth(1).wait_for(state="attached", timeout=hang_guard(240) * 1000)
        assert links.count() >= 2, name
        assert f"final_loss/{name.replace('=', '_')}" in text
    assert "sweep/best_final_loss" in text and "final loss (last 10%)" in text
    assert page.get_by_role("link", name="All 2 arms: loss curves, parallel coordinates").count() == 1


def test_the_collapsed_parent_run_charts_every_arms_loss(ui, page) -> None:
    """The runs' chart view with nothing expanded: the parent run's own metrics are the arms' losses."""
    sweep, base = ui
    url = f"{base}/{ui_page(sweep.experiment_id, compareRunsMode='CHART')}"
    text = open_page(page, url, "train_loss", "final_loss")
    for name in ARMS:
        label = name.replace("=", "_")
        assert page.get_by_text(f"train_loss/{label}", exact=True).count() >= 1 or label in text


def test_the_sweep_view_shows_the_loss_of_every_arm_in_one_chart(ui, page) -> None:
    sweep, base = ui
    text = open_page(page, f"{base}/{sweep.view_page}", "You're viewing a shared view", *ARMS, "Parallel Coordinates")
    assert f"sweep {sweep.dir.name}" in text and "2 matching runs" in text
    legend = page.locator(".js-plotly-plot").first
    assert legend.is_visible()
    for name in ARMS:  # both arms' curves in the first chart, train/loss
        assert page.get_by_text(f"{name} (train/loss)", exact=True).count() >= 1
    assert text.index("train/loss") < text.index("Parallel Coordinates")  # the loss chart comes first


def test_the_compare_view_plots_the_loss_not_a_system_metric(ui, page) -> None:
    from mlflow import MlflowClient

    sweep, base = ui
    client = MlflowClient(tracking_uri=sweep.uri)
    for run_id in sweep.arms.values():  # system metrics were logged (at the end at least): the view could pick one
        keys = [m.key for m in client.get_run(run_id).data._metric_objs]
        assert keys[0] == "train/loss" and any(k.startswith("system/") for k in keys)
    runs = json.dumps(list(sweep.arms.values()))
    url = f"{base}/#/compare-runs?runs={runs}&experiments={json.dumps([sweep.experiment_id])}"
    text = open_page(page, url, "Parallel Coordinates Plot", "Metrics:")
    chosen = text[text.index("Metrics:") : text.index("Clear All")]
    assert "train/loss" in chosen and "system/" not in chosen


def test_a_killed_and_resumed_runs_chart_has_one_point_per_step(ui, page, cache_dir: Path, tmp_path: Path) -> None:
    """SIGKILLed after step 7 (checkpoint at 4) and restarted by torch elastic: steps 5-7 run twice, but the metric
    page's full-resolution chart (what it fetches: ``get-history``) gets each step once, of the loss and of the
    learning rate, which the lean store thins in long runs only: a 10-step run's curve has every logged point.

    Catches: a resumed run that sends the replayed steps again (the chart zig-zags between two values per step); a
    short run whose ``train/lr`` is a two-point line (the lean store's fixed stride of 100 steps before). The
    timestamps show the oracle is not vacuous: the killed attempt's points past the checkpoint did reach MLflow.
    """
    sweep, base = ui
    tiny = [o for o in TINY_OVERRIDES if not o.startswith(("train.checkpoint_every", "tracker.experiment"))]
    cmd = [sys.executable, str(ROOT / "train.py"), *tiny, "train.steps=10", "train.checkpoint_every=4"]
    cmd += ["fault=kill", "fault.kill_random=0", "fault.kill_at=[7]", "cluster.max_restarts=1"]
    cmd += [f"tracker.uri={sweep.uri}", "tracker.run_name=killed", f"data.cache_dir={cache_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard(900),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "step_00000004 at step 4" in (tmp_path / "run" / "train.log").read_text()  # it did resume, from step 4
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=sweep.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hlat").experiment_id], "tags.mlflow.runName='killed'")
    rid, eid = run.info.run_id, run.info.experiment_id
    fetched: list[Any] = []

    def history(response: Any) -> None:
        if "/metrics/get-history?" in response.url and rid in response.url:
            fetched.append(response)

    page.on("response", history)
    q = lambda v: quote(json.dumps(v))  # noqa: E731
    keys = ["train/loss", "train/lr"]
    url = f"{base}/#/metric/train%2Floss?runs={q([rid])}&metric={q('train/loss')}&experiments={q([eid])}"
    url += f"&plot_metric_keys={q(keys)}&plot_layout={q({})}&x_axis=step&y_axis_scale=linear"
    url += f"&line_smoothness=1&show_point=true&deselected_curves={q([])}&last_linear_y_axis_range={q([])}"
    open_page(page, url, "killed (train/loss)", "killed (train/lr)")
    deadline = time.monotonic() + hang_guard(120)
    latest: dict[str, Any] = {}  # per metric, the last history the page fetched (it may fetch one again)
    while set(latest) != set(keys):
        assert time.monotonic() < deadline, f"the metric page fetched the history of {sorted(latest)} only"
        page.wait_for_timeout(200)
        for response in fetched:
            key = parse_qs(urlparse(response.url).query).get("metric_key", [""])[0]
            if key in keys:
                latest[key] = response
    page.remove_listener("response", history)
    points = {key: [p for p in latest[key].json()["metrics"] if p["key"] == key] for key in keys}
    for key in keys:  # each step once: every point the run logged
        steps = [p["step"] for p in points[key]]
        assert sorted(steps) == list(range(1, 11)), (key, steps)
    stamp = {p["step"]: p["timestamp"] for p in points["train/loss"]}
    # Step 5 kept from the killed attempt (one step after step 4), not resent by the next one (a restart after it):
    assert stamp[5] - stamp[4] < stamp[9] - stamp[5], stamp
