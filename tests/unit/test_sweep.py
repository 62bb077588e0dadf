"""Sweep jobs: config hash, skip / continue / train decisions from MLflow, rank agreement, objective, resolvers."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import pytest

from hlat import checkpoint
from hlat.config import ConfigError, resolvers, to_run_config
from hlat.launch import rendezvous
from hlat.sweep import job as sweep_job
from hlat.track import runs, sweep
from tests.conftest import compose_cfg, lock_held_elsewhere
from tests.timeouts import hang_guard


def run_config(tmp_path: Path, *overrides: str):
    return to_run_config(
        compose_cfg(f"tracker.uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracker.experiment=sw", *overrides)
    )


def client(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def make_run(tmp_path: Path, h: str, status: str, **tags: str) -> str:
    c = client(tmp_path)
    exp = c.get_experiment_by_name("sw")
    exp_id = exp.experiment_id if exp else c.create_experiment("sw")
    run = c.create_run(exp_id, tags={sweep.HASH_TAG: h, **tags})
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.5, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.0], start=1):
        c.log_metric(run.info.run_id, "train/loss", loss, step=step)
    c.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_config_hash_ignores_where_output_goes_but_not_what_is_computed(tmp_path: Path) -> None:
    base = dataclasses.asdict(run_config(tmp_path))
    same = dataclasses.asdict(
        run_config(
            tmp_path,
            "train.checkpoint_dir=/elsewhere",
            "tracker.run_name=x",
            "train.resume=never",
            "fault=kill",
            "data.worker=none",
        )
    )
    assert sweep.config_hash(same) == sweep.config_hash(base)
    for override in ("optimizer.beta2=0.99", "model.scaled_init=false", "train.seed=1", "precision=bf16_sr"):
        assert sweep.config_hash(dataclasses.asdict(run_config(tmp_path, override))) != sweep.config_hash(base)


def test_decide_trains_skips_a_finished_run_and_continues_a_dead_one(tmp_path: Path, monkeypatch) -> None:
    cfg = run_config(tmp_path)
    h = sweep.config_hash(dataclasses.asdict(cfg))
    assert sweep_job.decide(cfg, tmp_path / "job0").action == "train"  # nothing in MLflow yet

    dead_root = tmp_path / "old" / "checkpoints"
    dead_root.mkdir(parents=True)
    dead = make_run(tmp_path, h, "KILLED", checkpoint_dir=str(dead_root), run_dir=str(tmp_path / "old"))
    monkeypatch.setattr(checkpoint, "latest", lambda root: root / "step_00000004" if root == dead_root else None)
    d = sweep_job.decide(cfg, tmp_path / "job1")
    assert (d.action, d.run_id, d.checkpoint_dir) == ("resume", dead, str(dead_root))

    # A live trainer holds that directory (another sweep still running it): train afresh instead of sharing it.
    lock = checkpoint.hold_lock(dead_root)
    try:
        assert sweep_job.decide(cfg, tmp_path / "job2").action == "train"
    finally:
        lock.close()

    finished = make_run(tmp_path, h, "FINISHED")
    make_run(tmp_path, "0" * 16, "FINISHED")  # another config: never picked
    d = sweep_job.decide(cfg, tmp_path / "job3")
    assert (d.action, d.run_id, d.config_hash) == ("skip", finished, h)
    record = json.loads((tmp_path / "job3" / sweep.JOB_FILE).read_text())
    assert record["decision"]["action"] == "skip"

    off = run_config(tmp_path, "tracker.skip_finished=false")
    assert sweep_job.decide(off, tmp_path / "job4").action == "train"


def test_a_restarted_job_keeps_its_first_decision_and_other_ranks_follow_rank_0(tmp_path: Path, monkeypatch) -> None:
    cfg = run_config(tmp_path)
    job = tmp_path / "job"
    first = sweep_job.decide(cfg, job)
    make_run(tmp_path, first.config_hash, "FINISHED")  # finished after this job decided to train
    assert sweep_job.decide(cfg, job) == first  # the restart does not skip its own job

    other = tmp_path / "other"
    monkeypatch.setenv("RANK", "1")
    decided: list = []
    t = threading.Thread(target=lambda: decided.append(sweep_job.decide(cfg, other)))
    t.start()
    time.sleep(0.5)
    assert not decided  # rank 1 waits for rank 0's record, it never asks MLflow itself
    other.mkdir()
    (other / sweep.JOB_FILE).write_text(json.dumps({"decision": {"action": "skip", "config_hash": "h", "run_id": "r"}}))
    t.join(timeout=hang_guard(120))
    assert decided == [sweep_job.Decision("skip", "h", run_id="r")]


def test_a_rank_waiting_for_rank_0_gives_up_with_the_reason(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(TimeoutError, match=r"rank 3 waited .* rank 0 .*\(hydra.sweep.dir\)"):
        sweep_job._wait_for(tmp_path, "decision", timeout_s=0.3)


def test_objective_is_the_tail_mean_from_mlflow_and_finish_records_it(tmp_path: Path) -> None:
    run_id = make_run(tmp_path, "h", "FINISHED")
    value = runs.objective(f"sqlite:///{tmp_path / 'mlflow.db'}", run_id, [])
    assert value == pytest.approx(1.0)  # 12 points: the last one
    assert runs.objective(None, None, [4.0] * 10 + [2.0, 1.0]) == pytest.approx(1.0)
    assert math.isnan(runs.objective(None, None, []))
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    sweep_job.finish_job(job, mlflow_run_id=run_id, status="finished", objective=value)
    assert sweep_job.job_objective(job) == value
    sweep_job.finish_job(job, mlflow_run_id=run_id, status="finished", objective=math.nan)
    assert sweep_job.job_objective(job) == math.inf  # diverged: the worst value for a minimizing sweeper
    assert sweep.recorded_run_ids(tmp_path / "sweep") == [run_id]


def test_parent_tags_only_for_a_sweep_of_the_same_experiment(tmp_path: Path) -> None:
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    assert sweep.parent_tags(job, "sw") == {}
    (tmp_path / "sweep" / sweep.SWEEP_FILE).write_text(json.dumps({"parent_run_id": "p", "experiment": "sw"}))
    assert sweep.parent_tags(job, "sw")["mlflow.parentRunId"] == "p"
    assert sweep.parent_tags(job, "other") == {}


def test_directory_lock_refuses_a_second_trainer(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert not checkpoint.is_locked(root)
    with lock_held_elsewhere(root):
        assert checkpoint.is_locked(root)
        with pytest.raises(ConfigError, match=r"another process is training into .*hydra\.run\.dir"):
            checkpoint.hold_lock(root)
    assert not checkpoint.is_locked(root)  # a killed trainer leaves no lock behind
    checkpoint.hold_lock(root).close()


def test_rank_resolvers_and_the_job_stamp_shared_through_the_agent_store(monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert (resolvers.rank_zero_only(".hydra"), resolvers.rank_suffix()) == (".hydra", "")
    monkeypatch.setenv("SLURM_PROCID", "2")  # one Slurm task per node
    assert (resolvers.rank_zero_only(".hydra"), resolvers.rank_suffix()) == (None, "_rank2")
    monkeypatch.setenv("RANK", "0")  # torchrun's RANK wins
    assert resolvers.global_rank() == 0

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the torchrun agent's store
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    first = resolvers.job_stamp()
    assert store.get("hlat/job_stamp").decode() == first  # the first rank to ask stores its time
    store.set("hlat/job_stamp", "2020-01-01/00-00-00")  # as if that rank had asked long ago
    assert resolvers.job_stamp() == "2020-01-01/00-00-00"  # every later rank (or a restart) gets the stored value


def test_slurm_rendezvous_meets_at_the_first_host(monkeypatch) -> None:
    assert rendezvous.slurm_rendezvous() is None
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for key, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "trn-[3-6]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "4",
    }.items():
        monkeypatch.setenv(key, value)
    assert rendezvous.slurm_rendezvous() == (f"trn-3:{rendezvous.RDZV_PORT}", "slurm-77", 4)


def test_a_sweep_job_is_named_by_the_overrides_that_tell_it_from_the_others(tmp_path: Path, monkeypatch) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    command_line = ["model.dim=64", "optimizer.beta2=0.95,0.99", "tracker.plots=false", "optimizer.lr=range(1,3)"]
    job = ["model.dim=64", "optimizer.beta2=0.99", "tracker.plots=False", "optimizer.lr=2", "model.scaled_init=true"]
    # swept on the command line (a list, a range) or by the sweeper's own params (absent from the command line)
    assert sweep.swept_overrides(job, command_line) == [
        "optimizer.beta2=0.99",
        "optimizer.lr=2",
        "model.scaled_init=true",
    ]
    assert sweep.swept_overrides(["model.dim=64"], ["model.dim=64"]) == []

    job_dir = tmp_path / "sweep" / "1"
    job_dir.mkdir(parents=True)
    assert sweep.default_run_name(job_dir) is None  # no tracked sweep around it
    (tmp_path / "sweep" / sweep.SWEEP_FILE).write_text(json.dumps({"parent_run_id": "p", "overrides": command_line}))
    hydra = OmegaConf.create({"hydra": {"overrides": {"task": job}}})
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra.hydra))  # what the job sees, any launcher
    assert sweep.default_run_name(job_dir) == "optimizer.beta2=0.99,optimizer.lr=2,model.scaled_init=true"

    cfg = to_run_config(compose_cfg("tracker.experiment=sw"))
    named = sweep_job._named(cfg, job_dir)
    name = "optimizer.beta2=0.99,optimizer.lr=2,model.scaled_init=true"
    assert named.tracker.run_name == name and dataclasses.replace(named, tracker=cfg.tracker) == cfg  # only the name
    mine = to_run_config(compose_cfg("tracker.run_name=mine"))
    assert sweep_job._named(mine, job_dir).tracker.run_name == "mine"  # the user's name wins


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_logs_info_to_the_console_under_any_launcher(tmp_path: Path, monkeypatch, capfd, rank) -> None:
    import logging

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log
    from omegaconf import open_dict

    from tests.conftest import CONF

    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.setenv("RANK", rank)  # an external torchrun's (srun's SLURM_PROCID alike)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir, cfg.hydra.job.name = str(tmp_path), "train"
    HydraConfig.instance().set_config(cfg)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_log(cfg.hydra.hydra_logging)  # what Hydra does first: its own lines ([HYDRA] Launching ...)
        logging.getLogger("hydra.launcher").info("hydra's narration")
        for h in root.handlers:
            h.flush()
        configure_log(cfg.hydra.job_logging)  # what Hydra does in every job process
        logging.getLogger("hlat.test").info("narration")
        logging.getLogger("hlat.test").warning("a problem")
        for h in root.handlers:
            h.flush()
    finally:
        for h in root.handlers:
            if h not in saved[0]:
                h.close()
        root.handlers[:], root.level = saved
    out = capfd.readouterr().out
    assert "a problem" in out and ("narration" in out) == (rank == "0")  # rank N: warnings and worse only
    assert ("[HYDRA] hydra's narration" in out) == (rank == "0")
    log_file = tmp_path / ("train.log" if rank == "0" else f"train_rank{rank}.log")
    assert "narration" in log_file.read_text()  # every rank keeps INFO in its own file
