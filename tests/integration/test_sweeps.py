"""Multiruns through the real command line: every sweeps/ config, resume after a killed sweep, Optuna, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hlat.config import RunConfig, to_run_config
from hlat.parallel import ParallelDims
from hlat.track import sweep
from tests.integration.test_train import ROOT, cli
from tests.timeouts import hang_guard

SWEEPS = ROOT / "sweeps"
FAST = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "optimizer.warmup_steps=1",
    "tracker.plots=false",
    "tracker.system_metrics=false",
    "tracker.flush_every_s=0",
    "tracker.experiment=sw",
    "train.async_checkpoint=false",
    "health=off",
]


def sweep_configs() -> list[str]:
    return sorted(p.stem for p in SWEEPS.glob("*.yaml") if not p.stem.startswith("_"))


def job_overrides(params: dict[str, str]) -> list[list[str]]:
    """The basic sweeper's jobs: the cartesian product of the comma-separated values."""
    jobs: list[list[str]] = [[]]
    for key, values in params.items():
        jobs = [[*job, f"{key}={v}"] for job in jobs for v in str(values).split(",")]
    return jobs


@pytest.mark.parametrize("name", sweep_configs())
def test_every_job_of_every_sweep_config_is_a_valid_run(name: str, cache_dir: Path) -> None:
    with initialize_config_dir(config_dir=str(SWEEPS), version_base="1.3"):
        search = [f"hydra.searchpath=[file://{ROOT / 'conf'}]"]
        master = compose(config_name=name, overrides=search, return_hydra_config=True)
        sweeper = master.hydra.sweeper
        optuna = "optuna" in sweeper._target_
        params = {"optimizer.lr": "1e-3", "optimizer.warmup_steps": "5"} if optuna else dict(sweeper.params)
        jobs = job_overrides(params)
        assert len(jobs) >= (1 if optuna else 2), f"sweeps/{name}.yaml sweeps nothing"
        assert "tracker.experiment" not in params and master.tracker.experiment not in ("hlat", None)
        assert master.tracker.run_name is None, "runs are named by the overrides that differ between the jobs"
        for overrides in jobs:
            cfg = compose(config_name=name, overrides=[*search, *overrides], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # ${hydra:job.override_dirname} in the run name
            container = OmegaConf.to_container(cfg, resolve=False)
            del container["hydra"]
            run = to_run_config(OmegaConf.merge(OmegaConf.structured(RunConfig), container))  # every schema check
            assert run.train.steps > run.optimizer.warmup_steps
            ParallelDims.build(run.parallelism, run.cluster.world_size, run.model, run.train)  # batch x layout


def records(sweep_dir: Path) -> dict[str, dict]:
    return {d.name: r for d, r in sweep.job_records(sweep_dir).items()}


def new_sweep(root: Path, seen: set[Path]) -> Path:
    """The one sweep directory under ``root`` that is not in ``seen`` (which it joins)."""
    dirs = {p.parent for p in root.rglob("multirun/**/sweep.json")} - seen
    assert len(dirs) == 1, dirs
    seen |= dirs
    return dirs.pop()


@pytest.mark.slow
def test_a_killed_sweep_run_again_continues_its_dead_job_then_skips_everything(tmp_path: Path, cache_dir) -> None:
    from mlflow import MlflowClient

    args = ["-m", *FAST, f"data.cache_dir={cache_dir}", "train.steps=6", "optimizer.beta2=0.95,0.99"]
    killed = cli(*args, "fault=kill", "fault.kill_random=0", "fault.kill_at=[3]", cwd=tmp_path, timeout=hang_guard(900))
    assert killed.returncode != 0  # SIGKILL took the whole sweep down in job 0, before job 1 started
    seen: set[Path] = set()
    first = new_sweep(tmp_path, seen)
    assert set(records(first)) == {"0"} and "status" not in records(first)["0"]

    again = cli(*args, cwd=tmp_path, timeout=hang_guard(900))
    assert again.returncode == 0, again.stderr[-3000:]
    second = new_sweep(tmp_path, seen)
    rec = records(second)
    assert rec["0"]["decision"]["action"] == "resume" and rec["1"]["decision"]["action"] == "train"
    assert {r["status"] for r in rec.values()} == {"finished"}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sw")
    runs = client.search_runs([exp.experiment_id], f"tags.`{sweep.HASH_TAG}` != ''")
    assert len(runs) == 2  # the dead job's run was continued, not duplicated
    continued = client.get_run(rec["0"]["mlflow_run_id"])
    assert continued.info.status == "FINISHED"
    assert continued.data.tags["mlflow.parentRunId"] == json.loads((second / "sweep.json").read_text())["parent_run_id"]
    steps = sorted({m.step for m in client.get_metric_history(continued.info.run_id, "train/loss")})
    assert steps == [1, 2, 3, 4, 5, 6]  # one run holds the whole history, across the kill
    assert "| 0.95 |" in (second / "comparison.md").read_text() and (second / "comparison.png").exists()

    third = cli(*args, cwd=tmp_path, timeout=hang_guard(900))
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stdout.count("hlat: skipped") == 2
    rec3 = records(new_sweep(tmp_path, seen))
    assert {r["status"] for r in rec3.values()} == {"skipped"}
    assert {k: r["objective"] for k, r in rec3.items()} == {k: r["objective"] for k, r in rec.items()}
    assert len(client.search_runs([exp.experiment_id], f"tags.`{sweep.HASH_TAG}` != ''")) == 2


def _kill_when_hanging(sweep: subprocess.Popen, root: Path, job: str, timeout_s: float | None = None) -> None:
    """SIGKILL, from outside, the process of sweep job ``job`` once it hangs (``fault.hang_at``, after a checkpoint)."""
    import psutil

    deadline = time.monotonic() + (hang_guard(900) if timeout_s is None else timeout_s)
    while not (markers := list(root.glob(f"multirun/*/*/{job}/checkpoints/faults/hang-*"))):
        assert sweep.poll() is None and time.monotonic() < deadline, "the job never reached its hang"
        time.sleep(0.2)
    lock = str((markers[0].parents[1] / ".lock").resolve())  # held by the job's trainer (job_dir.hold_lock)
    holders = [
        p for p in psutil.Process(sweep.pid).children(recursive=True) if any(f.path == lock for f in p.open_files())
    ]
    assert len(holders) == 1, holders
    holders[0].send_signal(signal.SIGKILL)


@pytest.mark.slow
def test_a_job_killed_under_submitit_fails_the_sweep_after_the_others_and_continues_when_run_again(
    tmp_path: Path, cache_dir
) -> None:
    from mlflow import MlflowClient

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = ["-m", *FAST, f"data.cache_dir={cache_dir}", "train.steps=4,6", "hydra/launcher=submitit_local"]
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "fault.hang_at=5", "fault.hang_rank=0"]
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        _kill_when_hanging(p, tmp_path, "1")  # job 1 (6 steps) hangs after step 5; its checkpoint is step 4
        out, err = p.communicate(timeout=hang_guard(900))
    assert p.returncode == 1, err[-3000:]  # the sweep survived the kill, compared, then failed
    seen: set[Path] = set()
    first = new_sweep(tmp_path, seen)
    rec = records(first)
    assert rec["0"]["status"] == "finished" and rec["1"]["status"] == "killed"
    assert "did not finish: 1 killed (logs: " in err and "/1/train.log" in err and "_log.err" in err  # named, logs
    assert "| train.steps=4 |" in out and "| train.steps=6 |" in out  # compared; runs named by their overrides
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(json.loads((first / "sweep.json").read_text())["parent_run_id"])
    killed = client.get_run(rec["1"]["mlflow_run_id"])
    assert parent.info.status == "KILLED" and killed.info.status == "KILLED"  # never left RUNNING
    assert {killed.info.run_name, client.get_run(rec["0"]["mlflow_run_id"]).info.run_name} == {
        "train.steps=6",
        "train.steps=4",
    }

    again = cli(*args, cwd=tmp_path, timeout=hang_guard(900))  # the fault is not part of the job's identity
    assert again.returncode == 0, again.stderr[-3000:]
    rec2 = records(new_sweep(tmp_path, seen))
    assert rec2["0"]["status"] == "skipped" and rec2["1"]["decision"]["action"] == "resume"
    assert rec2["1"]["status"] == "finished" and rec2["1"]["mlflow_run_id"] == killed.info.run_id  # the same run
    steps = sorted({m.step for m in client.get_metric_history(killed.info.run_id, "train/loss")})
    assert steps == [1, 2, 3, 4, 5, 6] and client.get_run(killed.info.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_optuna_sweep_minimizes_the_recorded_objective_and_replays_from_mlflow(tmp_path: Path, cache_dir) -> None:
    args = [
        "-m",
        "--config-dir",
        str(SWEEPS),
        "--config-name",
        "lr_warmup_optuna",
        *FAST,
        f"data.cache_dir={cache_dir}",
        "train.steps=4",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=1",
        "optimizer.warmup_steps=range(1, 3)",
    ]
    first = cli(*args, cwd=tmp_path, timeout=hang_guard(900))
    assert first.returncode == 0, first.stderr[-3000:]
    seen: set[Path] = set()
    sweep_dir = new_sweep(tmp_path, seen)
    objectives = [r["objective"] for r in records(sweep_dir).values()]
    result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert result["best_value"] == pytest.approx(min(objectives))

    again = cli(*args, cwd=tmp_path, timeout=hang_guard(900))  # seeded TPE asks the same trials; MLflow answers them
    assert again.returncode == 0, again.stderr[-3000:]
    replay = new_sweep(tmp_path, seen)
    assert {r["status"] for r in records(replay).values()} == {"skipped"}
    assert yaml.safe_load((replay / "optimization_results.yaml").read_text()) == result


@pytest.mark.slow
def test_multirun_under_torchrun_shares_one_directory_per_job(tmp_path: Path, cache_dir) -> None:
    from mlflow import MlflowClient

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        "-m",
        *FAST,
        f"data.cache_dir={cache_dir}",
        "cluster=cpu_x2",
        "train.steps=2",
        "train.global_batch_size=8",
        "optimizer.beta2=0.95,0.99",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_guard(900))
    assert r.returncode == 0, r.stderr[-3000:]
    sweep_dir = new_sweep(tmp_path, set())  # both ranks: one sweep directory (hlat.job_stamp through the agent store)
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        d = sweep_dir / job
        assert (d / ".hydra" / "config.yaml").exists()
        assert (d / "train.log").exists() and (d / "train_rank1.log").exists()  # one log file per rank
        assert records(sweep_dir)[job]["status"] == "finished"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sw")
    assert len(client.search_runs([exp.experiment_id], f"tags.`{sweep.HASH_TAG}` != ''")) == 2  # rank 0 only


def test_slurm_launcher_preset_asks_one_exclusive_task_per_node_of_the_cluster(tmp_path: Path, monkeypatch) -> None:
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit only checks that Slurm is installed
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", "cluster=trn1_x4", "hydra.launcher.partition=train"],
            return_hydra_config=True,
        )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert params["nodes"] == "${cluster.nodes}"
    assert params["cpus_per_task"] == "${cluster.cpus_per_task}"  # the cluster preset carries it
    params["nodes"], params["name"] = cfg.cluster.nodes, "train"  # what the launcher resolves in the sweep
    params["cpus_per_task"] = cfg.cluster.cpus_per_task
    # The plugin's own mapping (SlurmLauncher.launch): base keys as they are, the others prefixed slurm_.
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor = submitit.AutoExecutor(
        folder=str(tmp_path), cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    params.pop("_target_"), params.pop("submitit_folder")
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    sbatch = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --partition=train",
        "#SBATCH --time=4320",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --cpus-per-task=128",
    ):
        assert line in sbatch, sbatch
