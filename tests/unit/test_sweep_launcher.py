"""hlat's submitit launchers: each job collected on its own, a dead job recorded, results that can be unpickled."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from hlat.sweep import launcher as sweep_launcher
from hlat.track import sweep
from hydra_plugins.hlat_sweep_launcher import LocalLauncher, SlurmLauncher


def _returns(value: object) -> JobReturn:
    """A job's JobReturn as Hydra's run_job builds it: FAILED with the exception, or COMPLETED with the value."""
    ret = JobReturn(overrides=["x=1"])
    failed = isinstance(value, BaseException)
    ret.status, ret._return_value = (JobStatus.FAILED if failed else JobStatus.COMPLETED), value
    return ret


def _signal_exception() -> JobReturn:
    """What a job that died by a signal inside torch elastic's agent returned: it pickles, but cannot be unpickled."""
    from torch.distributed.elastic.multiprocessing import SignalException

    return _returns(SignalException("Process 7 got signal: 15", sigval=15))


def test_an_exception_that_cannot_cross_the_pickle_boundary_becomes_a_plain_one() -> None:
    ret = _signal_exception()
    with pytest.raises(TypeError, match="sigval"):
        pickle.loads(pickle.dumps(ret))  # the launcher could not read this result
    back = pickle.loads(pickle.dumps(sweep_launcher.picklable(ret)))
    assert back.status == JobStatus.FAILED and type(back._return_value) is RuntimeError
    assert "SignalException: Process 7 got signal: 15" in str(back._return_value)
    ok = _returns(1.5)
    assert sweep_launcher.picklable(ok) is ok and ok.return_value == 1.5


def _dies() -> None:
    """A job whose process is killed before it reports (SIGKILL: the OOM killer, scancel's end, a lost node)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _launcher(tmp_path: Path) -> LocalLauncher:
    launcher = LocalLauncher(submitit_folder=str(tmp_path / ".submitit" / "%j"))
    launcher._job_dir = lambda overrides, idx: (tmp_path / "sweep" / str(idx), "run-of-job")  # no Hydra context
    return launcher


@pytest.mark.slow
def test_each_job_is_collected_on_its_own_and_a_dead_one_is_recorded(tmp_path: Path) -> None:
    import submitit

    executor = submitit.AutoExecutor(folder=tmp_path / ".submitit" / "%j", cluster="local")
    executor.update_parameters(timeout_min=5)
    killed = executor.submit(_dies)  # (a job cancel()-ed while still starting up may instead run to its end)
    unreadable = executor.submit(_signal_exception)
    finished = executor.submit(_returns, 2.5)
    raised = executor.submit(math.sqrt, -1)
    escaped = executor.submit(_returns, ValueError("raised past run_job"))  # Hydra's FAILED JobReturn
    launcher = _launcher(tmp_path)
    jobs = (killed, unreadable, finished, raised, escaped)
    rets = [launcher._collect(job, [f"x={i}"], i) for i, job in enumerate(jobs)]
    assert killed._results_timeout_s == sweep_launcher.LOCAL_RESULT_WAIT_S  # a dead local job is not waited 15 s for
    assert [r.status for r in rets] == [JobStatus.COMPLETED] * 5  # a failed JobReturn would end the sweeper
    assert [r.return_value for r in rets] == [math.inf, math.inf, 2.5, math.inf, math.inf]  # the worst objective
    records = {d.name: r for d, r in sweep.job_records(tmp_path / "sweep").items()}
    assert set(records) == {"0", "1", "3", "4"}
    assert records["4"]["status"] == "failed" and "ValueError: raised past run_job" in records["4"]["reason"]
    assert records["0"]["status"] == "killed" and "ended without a result" in records["0"]["reason"]
    assert records["1"]["status"] == "failed" and "TypeError" in records["1"]["reason"]
    assert records["3"]["status"] == "failed" and "math domain error" in records["3"]["reason"]
    assert records["0"]["mlflow_run_id"] == "run-of-job" and records["0"]["logs"][0].endswith("_log.out")


def test_a_dead_job_keeps_the_status_it_recorded_itself(tmp_path: Path) -> None:
    job = tmp_path / "0"
    job.mkdir()
    (job / sweep.JOB_FILE).write_text(json.dumps({"status": "preempted", "mlflow_run_id": "r"}))
    assert sweep.record_dead_job(job, "killed", "gone", logs=[], mlflow_run_id=None) == "preempted"
    assert sweep.read_record(job) == {"status": "preempted", "mlflow_run_id": "r"}
    assert sweep.record_dead_job(tmp_path / "1", "killed", "gone", logs=["a"], mlflow_run_id="s") == "killed"
    assert sweep.read_record(tmp_path / "1")["mlflow_run_id"] == "s"


def test_the_plugin_presets_are_swapped_for_hlats_launchers() -> None:
    plugin = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."
    for name in ("LocalLauncher", "SlurmLauncher"):
        config = OmegaConf.create({"hydra": {"launcher": {"_target_": plugin + name}}})
        OmegaConf.set_readonly(config, True)  # as Hydra hands it to the callback
        sweep_launcher.adopt(config)
        assert config.hydra.launcher._target_ == f"hydra_plugins.hlat_sweep_launcher.{name}"
    basic = OmegaConf.create({"hydra": {"launcher": {"_target_": "hydra._internal.core_plugins.BasicLauncher"}}})
    sweep_launcher.adopt(basic)
    assert basic.hydra.launcher._target_.endswith("BasicLauncher")
    assert issubclass(SlurmLauncher, sweep_launcher.CollectingLauncher)


def test_a_slurm_cluster_without_accounting_is_refused_with_the_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    sacct = tmp_path / "sacct"
    sacct.write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SystemExit) as e:
        SlurmLauncher(submitit_folder=str(tmp_path)).check_cluster()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "accounting storage is disabled" in err and "AccountingStorageType=accounting_storage/slurmdbd" in err
    sacct.write_text("#!/bin/sh\nexit 0\n")
    sweep_launcher.require_accounting()  # sacct answers: nothing to say
    assert LocalLauncher(submitit_folder=str(tmp_path)).check_cluster() is None  # nothing to check locally
