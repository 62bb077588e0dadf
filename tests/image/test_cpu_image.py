"""The cpu image, run as a user would: help, a training whose MLflow data outlives its container, a resume in a new
container, ``podman stop`` mid-run and a bitwise resume, a sweep with its comparison, an unwritable volume.

The oracle of the stop test is the same run never stopped, trained in the same image.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hlat import checkpoint
from hlat.launch.preempt import PREEMPTED_EXIT_CODE
from tests.image.conftest import STORE, TINY, mounts, podman
from tests.integration.test_fault_recovery import assert_same, state_of, strip_job
from tests.timeouts import hang_guard


def train(image: str, root: Path, *overrides: str, flags: tuple[str, ...] = ()) -> tuple[int, str]:
    """``podman run --rm`` of the image's entry point (``python train.py FLAGS``) on the volumes; exit code, output."""
    done = podman("run", "--rm", "--network", "none", *mounts(root), image, *flags, STORE, *TINY, *overrides)
    return done.returncode, done.stdout + done.stderr


def runs(root: Path, experiment: str = "hlat") -> list:
    """The MLflow runs of ``experiment`` in the store on the host volume."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def loss_steps(root: Path, run_id: str) -> list[int]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def test_hlat_help_runs_in_the_image(images: dict[str, str]) -> None:
    done = podman("run", "--rm", "--network", "none", "--entrypoint", "hlat", images["cpu"], "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "doctor" in done.stdout and "compare" in done.stdout


def test_a_run_outlives_its_container_and_resumes_into_the_same_mlflow_run(
    images: dict[str, str], volumes: Path
) -> None:
    run_dir = "hydra.run.dir=outputs/run"
    code, out = train(images["cpu"], volumes, "train.steps=2", "train.checkpoint_every=2", run_dir)
    assert code == 0, out[-4000:]
    [first] = runs(volumes)
    assert first.info.status == "FINISHED" and loss_steps(volumes, first.info.run_id) == [1, 2]
    artifacts = volumes / "mlruns" / first.info.experiment_id / first.info.run_id / "artifacts"
    assert any(artifacts.rglob("*")), "the run's artifacts are not on the volume"

    code, out = train(images["cpu"], volumes, "train.steps=4", "train.checkpoint_every=2", run_dir)  # a new one
    assert code == 0, out[-4000:]
    assert "resumed from" in (volumes / "outputs" / "run" / "train.log").read_text()
    [again] = runs(volumes)
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert loss_steps(volumes, again.info.run_id) == [1, 2, 3, 4]


def test_podman_stop_checkpoints_exits_85_and_a_new_container_resumes_bitwise(
    images: dict[str, str], volumes: Path, container_names: list[str]
) -> None:
    steps, grace = 40, 60
    stop_run = ("train.checkpoint_every=0", f"train.steps={steps}", "fault.min_step_s=0.1")  # paced: still running
    ref = volumes / "reference"
    for name in ("outputs", "mlruns"):
        (ref / name).mkdir(parents=True)
        os.chown(ref / name, 1000, 1000)
    code, out = train(images["cpu"], ref, *stop_run, "hydra.run.dir=outputs/run")
    assert code == 0, out[-4000:]

    name = f"hlat-stop-{os.getpid()}"
    container_names.append(name)
    podman(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "none",
        *mounts(volumes),
        images["cpu"],
        STORE,
        *TINY,
        *stop_run,
        f"train.preempt_grace_s={grace}",
        "hydra.run.dir=outputs/run",
        check=True,
    )
    wait_for_steps(3, name)  # the store is not read from the host while the container may still be creating it
    t0 = time.monotonic()
    podman("stop", "--time", str(grace), name, timeout=grace + 60, check=True)  # SIGTERM, SIGKILL after the grace
    took = time.monotonic() - t0
    code = int(podman("wait", name, check=True).stdout.strip())
    logs = podman("logs", name).stderr
    assert code == PREEMPTED_EXIT_CODE, logs[-4000:]
    assert took < grace, f"podman stop needed SIGKILL ({took:.0f} s)"
    root = volumes / "outputs" / "run" / "checkpoints"
    saved = checkpoint.latest(root)
    assert saved is not None and int(saved.name.removeprefix("step_")) < steps, logs[-4000:]

    code, out = train(images["cpu"], volumes, *stop_run, "hydra.run.dir=outputs/run")  # a new container
    assert code == 0, out[-4000:]
    assert f"resumed from /opt/hlat/outputs/run/checkpoints/{saved.name}" in out
    torch.set_num_threads(1)
    final = state_of(root / f"step_{steps:08d}", volumes)
    reference = state_of(ref / "outputs" / "run" / "checkpoints" / f"step_{steps:08d}", ref)
    assert_same(strip_job(final), strip_job(reference))  # weights, AdamW state, loader, RNG: bit for bit
    [run] = runs(volumes)
    assert run.info.status == "FINISHED" and loss_steps(volumes, run.info.run_id)[-1] == steps


def wait_for_steps(n: int, name: str) -> None:
    """Wait until the container has printed training step ``n`` (its progress line ``step n/...``)."""
    deadline = time.monotonic() + hang_guard(600)
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        logs = podman("logs", name)
        assert state == "true", logs.stderr[-4000:]
        if f"step {n}/" in logs.stdout + logs.stderr:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} printed no step {n}")


def test_a_two_arm_sweep_compares_its_runs_onto_the_volume(images: dict[str, str], volumes: Path) -> None:
    sweep = ("-m", "--config-dir", "sweeps", "--config-name", "scaled_init")
    code, out = train(images["cpu"], volumes, "hydra.sweep.dir=outputs/sweep", "train.steps=2", flags=sweep)
    assert code == 0, out[-4000:]
    table = (volumes / "outputs" / "sweep" / "comparison.md").read_text()
    assert "| model.scaled_init |" in table and "| True |" in table and "| False |" in table, table
    jobs = [r for r in runs(volumes, "ablation_scaled_init") if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.info.status for r in jobs) == ["FINISHED", "FINISHED"]


def test_an_unwritable_volume_gets_hlats_error_not_a_traceback(images: dict[str, str], volumes: Path) -> None:
    os.chown(volumes / "outputs", 0, 0)  # root's: the image's user 1000 cannot write it
    code, out = train(images["cpu"], volumes, "train.steps=2", "hydra.run.dir=outputs/run")
    assert code == 2 and "Traceback" not in out, out[-4000:]
    assert "hlat: configuration error: hydra.run.dir: cannot create or write the run directory outputs/run" in out
    assert "hlat runs as uid 1000: a host folder mounted here must be writable by uid 1000" in out

    os.chown(volumes / "outputs", 1000, 1000)
    os.chown(volumes / "mlruns", 0, 0)
    code, out = train(images["cpu"], volumes, "train.steps=2", "hydra.run.dir=outputs/run")
    assert code == 2 and "Traceback" not in out, out[-4000:]
    assert "hlat: configuration error: tracker.uri=sqlite:////opt/hlat/mlruns/mlflow.db" in out, out[-4000:]
