"""Regenerate docs/img/mlflow-sweep.png: a tiny sweep's comparison in MLflow's UI, as hlat's sweep output links it.

Trains a three-arm learning-rate sweep (``train.py -m``, about a minute on 2 CPU cores), starts ``mlflow server``
over its store, opens the sweep's view (the address the sweep prints after ``MLflow:``) in headless Chromium and
saves the page, reduced to 256 colours. Needs Debian's ``chromium`` and the ``playwright`` package (the dev extra),
the same as tests/integration/test_mlflow_ui.py, whose helpers it uses.

    python scripts/mlflow_ui_screenshot.py [--out docs/img/mlflow-sweep.png] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.integration.mlflow_ui import (  # noqa: E402
    MlflowServer,
    browser_missing,
    browser_page,
    close_assistant,
    init_store,
    open_page,
    run_sweep,
)

SWEEP = (
    "train.steps=60",
    "train.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=16",
    "optimizer.min_lr=0",
    "optimizer.lr=1e-3,3e-3,1e-2",
)
"""Three learning rates, 60 steps of 1,024 tokens: about a minute for the sweep on 2 idle CPU cores."""


def screenshot(work: Path, out: Path, width: int = 1440, height: int = 900) -> Path:
    """Train the sweep in ``work``, serve it, and save the view of its comparison to ``out``."""
    uri = f"sqlite:///{work / 'mlflow.db'}"
    init_store(uri)
    server = MlflowServer(uri, work).start()
    try:
        start = time.monotonic()
        sweep = run_sweep(work, work / "cache", *SWEEP)
        print(f"sweep trained in {time.monotonic() - start:.0f} s: {sweep.dir}")
        base = server.wait()
        with browser_page(width, height) as page:
            open_page(page, f"{base}/{sweep.view_page}", "You're viewing a shared view", *sweep.arms)
            close_assistant(page)
            page.locator('button[data-component-id="mlflow.experiment_page.shared_view.dismiss"]').click()
            page.locator(".js-plotly-plot").nth(2).wait_for()
            page.mouse.move(0, 0)  # no hover highlight where the banner's button was
            page.wait_for_timeout(3000)  # plotly's transitions
            page.screenshot(path=str(out))
    finally:
        server.stop()
    from PIL import Image

    with Image.open(out) as img:
        img.convert("RGB").quantize(colors=256).save(out, optimize=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, check the browser, make the screenshot; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "mlflow-sweep.png")
    ap.add_argument("--keep", type=Path, help="train and keep the store in this directory (default: a temporary one)")
    args = ap.parse_args(argv)
    why = browser_missing()
    if why is not None:
        print(f"mlflow_ui_screenshot: {why}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        path = screenshot(args.keep.resolve(), args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="hlat-mlflow-ui-") as work:
            path = screenshot(Path(work), args.out)
    print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
