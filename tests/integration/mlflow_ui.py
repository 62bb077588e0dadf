"""MLflow's UI over a real sweep in a real browser: helpers of test_mlflow_ui.py and scripts/mlflow_ui_screenshot.py.

A tiny sweep trained by ``train.py -m`` (:func:`run_sweep`), ``mlflow server`` over its store on a free local port
(:class:`MlflowServer`), and headless Chromium driven by Playwright (:func:`browser_page`): Debian's ``chromium``
package (``apt-get install chromium``), never a browser Playwright downloads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("HLAT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
TINY = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "train.checkpoint_every=1000",
    "optimizer.warmup_steps=1",
    "tracker.plots=false",
    "tracker.flush_every_s=0",
    "train.async_checkpoint=false",
    "health=off",
    "tracker.experiment=ablation",
]
"""A sweep job of a few seconds on 2 CPU cores. System metrics stay on (sampled every 0.5 s by :func:`run_sweep`)."""


def browser_missing() -> str | None:
    """Why the browser cannot be driven here (None: it can): Playwright's package or Debian's chromium is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not Path(CHROMIUM).is_file():
        return f"no chromium at {CHROMIUM} (apt-get install chromium; HLAT_CHROMIUM names another)"
    return None


@dataclass
class Sweep:
    """A finished sweep: its store, directory, MLflow ids and what it printed."""

    uri: str
    dir: Path
    experiment_id: str
    parent_run_id: str
    arms: dict[str, str]
    """Run name -> run id of each arm."""
    view_page: str
    """The UI page (``#/...``) of the sweep's saved view, as the sweep printed it."""
    stdout: str


def init_store(uri: str) -> None:
    """Create the store's tables now, so a server and a trainer starting at once do not both create them."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=uri).search_experiments()


def run_sweep(workdir: Path, cache_dir: Path, *overrides: str, timeout_s: float | None = None) -> Sweep:
    """``train.py -m`` with :data:`TINY` and ``overrides`` (they win) in ``workdir`` (store ``workdir/mlflow.db``).

    Raises:
        AssertionError: The sweep failed; its output tail says why.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"}
    keys = {o.split("=", 1)[0] for o in overrides}
    tiny = [o for o in TINY if o.split("=", 1)[0] not in keys]  # Hydra refuses a key given twice
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *tiny, f"data.cache_dir={cache_dir}", *overrides]
    timeout_s = hang_guard(1200) if timeout_s is None else timeout_s  # a hang guard
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (record,) = workdir.glob("multirun/*/*/sweep.json")
    parent = json.loads(record.read_text())
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=parent["uri"])
    experiment_id = client.get_run(parent["parent_run_id"]).info.experiment_id
    arms = {
        r.info.run_name: r.info.run_id
        for r in client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent['parent_run_id']}'")
    }
    (view,) = re.findall(r"^MLflow: .*http://127\.0\.0\.1:5000/(#/\S+)$", done.stdout, re.MULTILINE)
    return Sweep(parent["uri"], record.parent, experiment_id, parent["parent_run_id"], arms, view, done.stdout)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` over one store on 127.0.0.1 (one worker, no job runner): :meth:`start`, :meth:`wait`,
    :meth:`stop` (the whole process group: uvicorn and its worker)."""

    def __init__(self, uri: str, workdir: Path) -> None:
        self.uri, self.workdir, self.port = uri, workdir, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "mlflow-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MlflowServer:
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow) if mlflow.exists() else "mlflow",
            "server",
            "--backend-store-uri",
            self.uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait(self, timeout_s: float | None = None) -> str:
        """The server's address once ``/health`` answers.

        Raises:
            AssertionError: It exited or did not answer in ``timeout_s`` (its log's tail says why).
        """
        assert self.proc is not None
        timeout_s = hang_guard(600) if timeout_s is None else timeout_s  # a hang guard
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return self.base
            except OSError:
                pass
            tail = self.log.read_text(errors="replace")[-3000:]
            assert self.proc.poll() is None, f"mlflow server exited {self.proc.returncode}:\n{tail}"
            assert time.monotonic() < deadline, f"mlflow server did not answer in {timeout_s:.0f} s:\n{tail}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server, uvicorn and the worker
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(hang_guard(60))


@contextmanager
def browser_page(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A Playwright page of a headless Chromium (:data:`CHROMIUM`, :data:`BROWSER_ARGS`)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(hang_guard(120) * 1000)  # ms; a hang guard
            yield page
        finally:
            browser.close()


def open_page(page: Any, url: str, *texts: str) -> str:
    """Go to ``url`` and wait until every one of ``texts`` shows; returns the page's visible text."""
    page.goto(url)
    for text in texts:
        page.get_by_text(text, exact=False).first.wait_for(state="visible")
    return page.inner_text("body")


def close_assistant(page: Any) -> None:
    """Close MLflow 3.17's assistant side panel, if open (it takes a third of the page)."""
    button = page.locator('button[data-component-id="mlflow.assistant.chat_panel.close"]')
    if button.count():
        button.first.click()
