"""Resume through ``train.py`` on another data-parallel degree and micro-batch: the same global batches as a run that
was never interrupted (the loader's position is per sequence slot of the global batch, ``hlat.data.slots``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.timeouts import hang_guard

TINY = [
    "model.n_layers=1",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=176",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.checkpoint_every=1",
    "train.keep_last=0",
    "train.async_checkpoint=false",
    "train.log_every=1",
    "optimizer.warmup_steps=1",
    "tracker.plots=false",
    "tracker.system_metrics=false",
    "tracker.flush_every_s=0",
    "health=off",
]
LOSS_TOLERANCE = 2e-3
"""The same batches give the same loss up to fp32 reduction order (DP=2 averages two half-batch means, then AdamW
amplifies last-bit gradient differences into ~lr-sized steps of a few weights); another batch changes it by ~0.1."""


class Recorder:
    """The trainer's loader, recording every micro-batch it hands out (an in-process observer, changing nothing; a
    mixture's batch passes on with its per-source tally)."""

    def __init__(self, loader: Any, seen: list[torch.Tensor]) -> None:
        self._loader, self._seen = loader, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __iter__(self) -> Recorder:
        return self

    def __next__(self) -> Any:
        batch = next(self._loader)
        self._seen.append(torch.cat([batch[0], batch[1][:, -1:]], dim=1))
        return batch


def recorded_run(monkeypatch: pytest.MonkeyPatch, run_dir: Path, *overrides: str) -> tuple[Any, list]:
    """``main`` on one process: its result and the global batches (sequences x tokens) it trained on."""
    import hlat.train.run as run
    from tests.conftest import run_config

    seen: list[torch.Tensor] = []
    build = run.build_loader
    monkeypatch.setattr(run, "build_loader", lambda *a, **kw: Recorder(build(*a, **kw), seen))
    result = run.main(run_config(*TINY, *overrides), run_dir=run_dir)
    monkeypatch.setattr(run, "build_loader", build)
    per_step = result.config.train.global_batch_size // result.config.train.micro_batch_size
    return result, [torch.cat(seen[i : i + per_step]) for i in range(0, len(seen), per_step)]


def train_in_process(monkeypatch: pytest.MonkeyPatch, run_dir: Path, *overrides: str) -> tuple[dict, list]:
    """``main`` on one process; the losses per step and the global batches (sequences x tokens) it trained on."""
    result, steps = recorded_run(monkeypatch, run_dir, *overrides)
    return dict(result.history.series("train/loss")), steps


def slot_cursors(step_dir: Path) -> list[dict]:
    """Every sequence slot's saved loader position in a checkpoint, gathered from all its ranks' files."""
    cursors: dict[int, dict] = {}
    for f in sorted(step_dir.glob("extra.rank*.pt")):
        data = torch.load(f, weights_only=True)["data"]
        cursors.update(zip(range(*data["slots"]), data["cursors"], strict=True))
    return [cursors[s] for s in sorted(cursors)]


def mlflow_losses(db: Path) -> dict[int, float]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


@pytest.mark.slow
def test_resume_on_another_dp_degree_and_micro_batch_trains_on_the_same_global_batches(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 (micro-batch 1) for 2 steps, resumed on DP=1 (micro-batch 4) to 4; DP=1 (micro-batch 2) for 2 steps,
    resumed on DP=2 (micro-batch 2) to 4; both against an uninterrupted DP=1 run (micro-batch 2).

    In-process legs compare the global batches' token ids directly; the DP=2 legs (train.py subprocesses) compare
    every step's checkpointed per-slot positions (equal positions after equal ones: the same tokens in between) and
    the losses.
    """
    from tests.integration.test_train import cli

    monkeypatch.chdir(tmp_path)
    data = f"data.cache_dir={cache_dir}"
    ref_dir, down, up = tmp_path / "ref", tmp_path / "down", tmp_path / "up"
    ref_loss, ref_batches = train_in_process(
        monkeypatch, ref_dir, data, "tracker=console", "train.micro_batch_size=2", "train.steps=4"
    )
    ref = ref_dir / "checkpoints"
    assert len(ref_batches) == 4 and ref_batches[0].shape == (4, 33)

    # 2 -> 1, micro-batch 1 -> 4, in the same run directory (train.resume=auto) and MLflow run.
    mlflow = ["tracker=mlflow", f"tracker.uri=sqlite:///{tmp_path / 'down.db'}", data]
    dp2 = ["cluster=cpu_x2", "train.micro_batch_size=1", "train.steps=2", f"hydra.run.dir={down}"]
    r = cli(*TINY, *mlflow, *dp2, cwd=tmp_path, timeout=hang_guard(900))
    assert r.returncode == 0, r.stderr[-3000:]
    for step in (1, 2):
        name = f"step_{step:08d}"
        assert slot_cursors(down / "checkpoints" / name) == slot_cursors(ref / name), step
    _, resumed = train_in_process(monkeypatch, down, *mlflow, "train.micro_batch_size=4", "train.steps=4")
    assert len(resumed) == 2 and all(torch.equal(a, b) for a, b in zip(resumed, ref_batches[2:], strict=True))
    losses = mlflow_losses(tmp_path / "down.db")  # one MLflow run across the change of layout
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(abs(losses[s] - ref_loss[s]) < LOSS_TOLERANCE for s in losses), (losses, ref_loss)

    # 1 -> 2: the uninterrupted run's first two checkpoints, continued by two ranks of micro-batch 2.
    (up / "checkpoints").mkdir(parents=True)
    for step in (1, 2):
        shutil.copytree(ref / f"step_{step:08d}", up / "checkpoints" / f"step_{step:08d}")
    mlflow = ["tracker=mlflow", f"tracker.uri=sqlite:///{tmp_path / 'up.db'}", data]
    dp2 = ["cluster=cpu_x2", "train.micro_batch_size=2", "train.steps=4", f"hydra.run.dir={up}"]
    r = cli(*TINY, *mlflow, *dp2, cwd=tmp_path, timeout=hang_guard(900))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in (up / "train.log").read_text()
    for step in (3, 4):
        name = f"step_{step:08d}"
        assert slot_cursors(up / "checkpoints" / name) == slot_cursors(ref / name), step
    losses = mlflow_losses(tmp_path / "up.db")
    assert sorted(losses) == [3, 4]
    assert all(abs(losses[s] - ref_loss[s]) < LOSS_TOLERANCE for s in losses), (losses, ref_loss)
