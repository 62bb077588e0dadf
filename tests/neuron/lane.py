"""What the NxD lane's tests share: the micro model and ``train``, which runs ``python train.py`` and reads its metrics.

Every scenario runs ``python train.py`` in a subprocess (the Neuron variables must be set before torch_xla is
imported, once per process) and reads the run's metrics back from its MLflow store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MICRO = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.vocab_size=512",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.steps=3",
    "optimizer.warmup_steps=1",
    "train.log_every=1",
    "health=off",
    "train.checkpoint_every=0",
    "tracker.flush_every_s=0",
]


KEYS = ("train/loss", "train/grad_norm")
EVERY_STEP_IN_MLFLOW = KEYS
"""What the lean MLflow store keeps at every step (hlat.track.series.LeanTracker); the rest comes from the series."""


def train(
    tmp: Path,
    name: str,
    cache: Path,
    *overrides: str,
    keys: tuple[str, ...] = KEYS,
    env: dict[str, str] | None = None,
    run_dir: Path | None = None,
    python: str = sys.executable,
) -> dict[str, list[float]]:
    """Run ``python train.py`` with ``overrides`` (and ``env`` added to this environment) as the MLflow run ``name``
    in ``run_dir`` (default ``tmp / name``; give another run the same one to resume it); each of ``keys``' logged
    values by step (default: the loss and the pre-clip grad norm). ``python``: another environment's interpreter."""
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp / 'mlflow.db'}"
    args = [
        python,
        str(ROOT / "train.py"),
        *MICRO,
        f"data.cache_dir={cache}",
        f"tracker.uri={store}",
        f"tracker.run_name={name}",
        f"hydra.run.dir={run_dir or tmp / name}",
        *overrides,
    ]
    r = subprocess.run(args, cwd=tmp, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs(client.get_experiment_by_name("hlat").experiment_id, f"tags.mlflow.runName = '{name}'")
    out = {}
    for key in keys:
        if key in EVERY_STEP_IN_MLFLOW:
            out[key] = [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
        else:  # MLflow keeps it at most every 100 steps; the run's Parquet series holds every logged value
            from hlat.track.series import read_series, to_points

            table = read_series((run_dir or tmp / name) / "checkpoints" / "series")
            out[key] = to_points(table, key)[1].tolist()
    return out
