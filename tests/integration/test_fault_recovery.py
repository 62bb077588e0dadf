"""Automatic fault recovery end to end: SIGKILLs under torch elastic, crashes in a save, corruption, a full disk,
non-finite steps. The oracle is an uninterrupted run: recovered runs must end bitwise equal to it.

Each non-finite-step policy is checked once, on the micro run of tests/integration/test_smoke.py (fast suite), through
:func:`check_nonfinite_policy` below; here only the unsupervised halt's message, through the command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hlat import checkpoint
from hlat.checkpoint import CheckpointError
from hlat.state import HaltedError
from hlat.track.runs import run_series
from hlat.train.run import main
from tests.conftest import run_config
from tests.integration.test_train import SMALL_RUN, cli
from tests.timeouts import hang_guard

pytestmark = pytest.mark.slow
STEPS = 24


def common(cache_dir: Path, db: Path) -> list[str]:
    return [
        *SMALL_RUN,
        f"train.steps={STEPS}",
        "train.checkpoint_every=4",
        "train.keep_last=2",
        "train.log_every=2",
        "optimizer.warmup_steps=2",
        f"data.cache_dir={cache_dir}",
        f"tracker.uri=sqlite:///{db}",
        "tracker.flush_every_s=0",
        "tracker.plots=false",
        "tracker.system_metrics=false",
        "health=off",
    ]  # recovery is the subject here, not the health checks


def state_of(ckpt: Path, tmp: Path) -> dict:
    """Everything a checkpoint holds, as plain tensors: weights, AdamW state, and the extra state."""
    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return {"dcp": torch.load(out, weights_only=True), "extra": torch.load(ckpt / "extra.rank0.pt", weights_only=True)}


def assert_same(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[dict, dict[int, float]]:
    """The uninterrupted run: its final checkpoint's state and its loss per step."""
    tmp = tmp_path_factory.mktemp("reference")
    result = main(run_config(*common(cache_dir, tmp / "mlflow.db")), run_dir=tmp / "run")
    final = state_of(tmp / "run" / "checkpoints" / f"step_{STEPS:08d}", tmp)
    return final, dict(result.history.series("train/loss"))


def mlflow_run(db: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, "a recovered job must continue one MLflow run"
    return client, runs[0]


def strip_job(state: dict) -> dict:
    """The job record (MLflow run id, uptime) and fault counters legitimately differ between two jobs."""
    extra = dict(state["extra"])
    extra.pop("job")
    return {**state, "extra": extra}


def test_random_sigkills_under_supervision_end_bitwise_equal(tmp_path: Path, cache_dir: Path, reference) -> None:
    seed = int.from_bytes(os.urandom(2), "little")
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "run"
    r = cli(
        *common(cache_dir, db),
        "fault=kill",
        "fault.kill_random=3",
        f"fault.seed={seed}",
        "cluster.max_restarts=3",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=hang_guard(1500),
    )
    assert r.returncode == 0, f"fault.seed={seed}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("SIGKILL after step") == 3 or r.stderr.count("SIGKILL after step") == 3
    final = state_of(run_dir / "checkpoints" / f"step_{STEPS:08d}", tmp_path)
    assert_same(strip_job(final), strip_job(reference[0]))  # weights, AdamW state, loader, RNG: bit for bit

    client, run = mlflow_run(db)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    for m in history:  # one loss per step: a replayed step is not sent again (it would be the very same loss)
        assert m.value == pytest.approx(reference[1][m.step], rel=0, abs=0), f"step {m.step}, fault.seed={seed}"
    restarts = max(client.get_metric_history(run.info.run_id, "uptime/restarts"), key=lambda m: m.step)
    assert restarts.value == 3.0
    series = run_series(client, run, ["train/loss"])  # the Parquet series across the kills: one value a step
    assert series is not None and list(series["train/loss"]) == sorted(reference[1].items()), f"fault.seed={seed}"


def test_restarts_that_die_in_start_up_are_counted(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    """uptime/restarts counts every start after the first, also those that die before the job record used to be
    rewritten (in the pre-flight check, building the loader): here 3 restarts, 2 of which died in start-up."""
    import hlat.train.run
    from hlat.health.report import PreflightError

    cfg = [*common(cache_dir, tmp_path / "mlflow.db"), "tracker=console", "train.steps=4", "train.log_every=4"]
    run_dir = tmp_path / "run"
    first = main(run_config(*cfg), run_dir=run_dir)
    assert first.history.series("uptime/restarts") == [(4, 0.0)]
    more = [*cfg[:-2], "train.steps=6", "train.log_every=2"]  # the job goes on from its step-4 checkpoint
    for where, error in (("preflight", PreflightError("injected")), ("build_loader", RuntimeError("injected"))):

        def fail(*args, error: Exception = error, **kwargs) -> None:
            raise error

        with monkeypatch.context() as m:
            m.setattr(hlat.train.run, where, fail)
            with pytest.raises(type(error), match="injected"):
                main(run_config(*more), run_dir=run_dir)
    resumed = main(run_config(*more), run_dir=run_dir)
    assert resumed.state.step == 6 and resumed.history.series("uptime/restarts") == [(6, 3.0)]
    assert checkpoint.read_job(run_dir / "checkpoints")["uptime"]["restarts"] == 3


def test_a_crash_in_a_save_and_a_corrupt_checkpoint_are_survived(tmp_path: Path, cache_dir: Path, reference) -> None:
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "run"
    r = cli(
        *common(cache_dir, db),
        "fault.crash_in_save_at=8",
        "fault.corrupt_at=16",
        "cluster.max_restarts=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=hang_guard(1500),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    log = (run_dir / "train.log").read_text()
    assert "step_00000008.tmp: an interrupted save" in log  # partial save ignored
    assert "resumed from" in log and "step_00000004 at step 4" in log
    assert "step_00000016: __0_0.distcp does not match its sha256" in log  # corruption caught by the checksum
    assert "step_00000012 at step 12" in log
    final = state_of(run_dir / "checkpoints" / f"step_{STEPS:08d}", tmp_path)
    assert_same(strip_job(final), strip_job(reference[0]))


def test_a_full_disk_stops_with_a_clear_error_and_the_rerun_loses_nothing(
    tmp_path: Path, cache_dir: Path, reference
) -> None:
    cfg = [*common(cache_dir, tmp_path / "mlflow.db"), "fault=disk_full", "fault.disk_full_at=8"]
    with pytest.raises(
        CheckpointError,
        match=r"no space left on the device writing checkpoint step_00000008 .* "
        r"earlier checkpoints are intact \(step_00000004\)",
    ):
        main(run_config(*cfg), run_dir=tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    assert checkpoint.latest(root) == root / "step_00000004" and not list(root.glob("*.tmp"))
    result = main(run_config(*cfg), run_dir=tmp_path / "run")  # the same command again: resume=auto
    assert result.state.step == STEPS
    final = state_of(root / f"step_{STEPS:08d}", tmp_path)
    assert_same(strip_job(final), strip_job(reference[0]))
    _, run = mlflow_run(tmp_path / "mlflow.db")
    assert run.info.run_id == result.mlflow_run_id


def check_nonfinite_policy(cfg: list[str], run_dir: Path, policy: str, at: int, steps: int, saved: int) -> Any:
    """Train ``cfg`` (a NaN gradient injected at step ``at`` of ``steps``) under ``train.on_nonfinite=policy``.

    halt: the run raises HaltedError naming the newest valid checkpoint (step ``saved``), and nothing later is saved.
    rollback / skip_step: the run finishes with one rollback (the batch of step ``at`` discarded) or one skipped
    update, and its last checkpoint is finite. Returns the run's result (None for halt).
    """
    root = run_dir / "checkpoints"
    cfg = [
        *cfg,
        "fault=nonfinite",
        f"fault.nonfinite_at=[{at}]",
        f"train.on_nonfinite={policy}",
        f"train.steps={steps}",
    ]
    if policy == "halt":
        with pytest.raises(
            HaltedError,
            match=rf"step {at}: the loss or the gradient norm is not finite .* newest "
            rf"valid checkpoint is .*step_{saved:08d}",
        ):
            main(run_config(*cfg), run_dir=run_dir)
        assert sorted(p.name for p in root.glob("step_*")) == [f"step_{saved:08d}"]  # nothing non-finite was saved
        return None
    result = main(run_config(*cfg), run_dir=run_dir)
    state = result.state
    assert state is not None and state.step == steps
    if policy == "rollback":
        assert (state.rollbacks, state.discarded_batches, state.skipped_updates) == (1, [at], 0)
    else:
        assert (state.rollbacks, state.discarded_batches, state.skipped_updates) == (0, [], 1)
    final = state_of(root / f"step_{steps:08d}", run_dir.parent)
    assert all(torch.isfinite(v).all() for v in final["dcp"]["model"].values())
    assert final["extra"]["train_state"]["step"] == steps
    return result


def test_errors_a_restart_cannot_fix_are_not_retried(tmp_path: Path, cache_dir: Path) -> None:
    """A worker's configuration error ends the supervised job at once (exit 2), without burning the restarts."""
    r = cli(
        *common(cache_dir, tmp_path / "mlflow.db"),
        f"train.resume={tmp_path / 'nowhere'}",
        "cluster.max_restarts=3",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"hlat: configuration error: train.resume={tmp_path / 'nowhere'}: no complete checkpoint" in r.stderr
    assert "restart 1 of this job" not in r.stdout + r.stderr


def test_an_unsupervised_halt_says_how_to_continue(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    r = cli(
        *common(cache_dir, tmp_path / "mlflow.db"),
        "fault=nonfinite",
        "fault.nonfinite_at=[6]",
        "train.steps=12",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "hlat: step 6: the loss or the gradient norm is not finite (train.on_nonfinite=halt)" in r.stderr
    hint = next(line for line in r.stderr.splitlines() if line.startswith("hlat: the run stopped"))
    assert "to continue it from step_00000004: python train.py" in hint and f"hydra.run.dir={run_dir}" in hint
    assert "'fault.nonfinite_at=[6]'" in hint  # quoted for the shell
