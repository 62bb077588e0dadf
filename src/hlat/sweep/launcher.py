"""Hydra's submitit launchers (``hydra/launcher=slurm``, ``hydra/launcher=submitit_local``), made to survive dead jobs.

The plugin's ``job.results()`` raises at the first cancelled, killed or unpicklable job, ending the sweep before it
can report. Here each job is collected alone: a dead one is recorded and reported as +inf. ``src/hydra_plugins/``
holds the two-line subclasses Hydra instantiates.
"""

from __future__ import annotations

import logging
import math
import pickle
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from omegaconf import OmegaConf, open_dict

from hlat.track import sweep

log = logging.getLogger(__name__)

LOCAL_RESULT_WAIT_S = 1
"""How long to wait for a dead local job's result file (submitit waits 15 s, for slow shared file systems)."""


PLUGIN = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."
"""Where the plugin's launchers live (``hydra/launcher=submitit_local``, ``submitit_slurm``)."""
OURS = "hydra_plugins.hlat_sweep_launcher."
"""Where hlat's live (``hydra/launcher=slurm``)."""


def adopt(config: Any) -> None:
    """Swap the plugin's launcher in a multirun's config for the subclass here (``SweepCallback`` at the sweep's start).

    Not a yaml of the same name: replacing the plugin's structured config so needs Hydra's deprecated schema matching.
    """
    from omegaconf import read_write

    target = str(config.hydra.launcher.get("_target_", ""))
    if target.startswith(PLUGIN) and target.rsplit(".", 1)[1] in ("LocalLauncher", "SlurmLauncher"):
        with read_write(config.hydra.launcher):
            config.hydra.launcher._target_ = OURS + target.rsplit(".", 1)[1]


def picklable(ret: JobReturn) -> JobReturn:
    """``ret`` with an exception that would not survive pickling replaced by a ``RuntimeError`` saying the same."""
    value = getattr(ret, "_return_value", None)
    if not isinstance(value, BaseException):
        return ret
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # e.g. torch elastic's SignalException, whose pickle lacks its sigval
        trace = "".join(traceback.format_exception(value))
        ret._return_value = RuntimeError(f"{type(value).__module__}.{type(value).__name__}: {value}\n{trace}")
    return ret


def _last_line(e: BaseException) -> str:
    """The line of an error that says what happened (submitit's FailedJobError: the job's exception, in its trace)."""
    from submitit.core.utils import FailedJobError  # lazily: Hydra imports this module at every start (plugins)

    if not isinstance(e, FailedJobError):
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    lines = [line for line in str(e).splitlines() if line.strip() and not line.startswith(("-", " ", "You can"))]
    return lines[-1] if lines else type(e).__name__


class CollectingLauncher(plugin.BaseSubmititLauncher):
    """A submitit launcher that collects every job's result on its own; a dead job fails the sweep at its end."""

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str, singleton_state: dict[type, Any]
    ) -> JobReturn:
        """Run one job (in the submitted process) and return what can be unpickled by the launcher."""
        return picklable(super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit the jobs as the plugin does, then wait for each one, turning a dead job into a recorded +inf."""
        import submitit

        assert self.config is not None and len(job_overrides) > 0
        self.check_cluster()
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **self._init_params())
        executor.update_parameters(**self._job_params())
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        state = plugin.Singleton.get_state()
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(plugin.filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", state))
        jobs = executor.map_array(self, *zip(*params, strict=True))
        return [self._collect(job, overrides, idx) for job, (overrides, _, idx, *_) in zip(jobs, params, strict=True)]

    def check_cluster(self) -> None:
        """Refuse a cluster on which the launcher could not tell that a job died (nothing to check locally)."""

    def _init_params(self) -> dict[str, Any]:
        """The executor's own arguments (the plugin's mapping): its folder and ``<executor>_max_num_timeout``."""
        out = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            out[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        return out

    def _job_params(self) -> dict[str, Any]:
        """The jobs' parameters (the plugin's mapping): shared keys as they are, the others ``<executor>_<key>``."""
        base = set(OmegaConf.structured(plugin.BaseQueueConf).keys())
        return {
            k if k in base else f"{self._EXECUTOR}_{k}": v
            for k, v in self.params.items()
            if k not in ("submitit_folder", "max_num_timeout")
        }

    def _collect(self, job: Any, overrides: list[str], idx: int) -> JobReturn:
        """The job's result; for a job that died, its record (:func:`hlat.track.sweep.record_dead_job`) and +inf."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        if self._EXECUTOR == "local":  # its result file is written before the process ends, on a local disk
            job._results_timeout_s = LOCAL_RESULT_WAIT_S
        try:
            ret = job.results()[0]
            if ret.status != JobStatus.FAILED:
                return ret
            # The task raised past sweep_job.run_job (which records its own failures): a sweeper would re-raise it.
            killed, what = False, f"raised {_last_line(ret._return_value)}"
        except Exception as e:
            # No result at all: the process died (cancelled, SIGKILL, out of memory, a lost node). Else the job
            # raised outside Hydra's job, or returned what cannot be unpickled here.
            killed = isinstance(e, UncompletedJobError) and not isinstance(e, FailedJobError)  # its subclass
            what = "ended without a result" if killed else f"failed: {_last_line(e)}"
        reason = f"submitit job {job.job_id} {what} (state {job.state})"
        job_dir, run_id = self._job_dir(overrides, idx)
        status = sweep.record_dead_job(
            job_dir,
            "killed" if killed else "failed",
            reason,
            mlflow_run_id=run_id,
            logs=[str(job.paths.stdout), str(job.paths.stderr)],
        )
        log.error("sweep job %s %s: %s; logs: %s, %s", job_dir, status, reason, job.paths.stdout, job.paths.stderr)
        ret = JobReturn(overrides=overrides, working_dir=str(job_dir))
        ret.status, ret.return_value = JobStatus.COMPLETED, math.inf  # the worst objective; SweepCallback fails it
        return ret

    def _job_dir(self, overrides: list[str], idx: int) -> tuple[Path, str | None]:
        """The job's output directory and the MLflow run its trainer recorded in its checkpoint directory, if any."""
        from hlat.checkpoint import read_job

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num, cfg.hydra.job.id = idx, f"job_id_for_{idx}"
            job_dir = sweep_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
            root = OmegaConf.select(cfg, "train.checkpoint_dir")
        except Exception:  # a config that does not compose or resolve here: the default directory, no run
            log.exception("could not compose the config of sweep job #%d", idx)
            return sweep_dir / str(idx), None
        root = Path(root).expanduser() if root else job_dir / "checkpoints"
        return job_dir, read_job(root).get("mlflow_run_id")


def accounting_problem() -> str | None:
    """Why ``sacct`` cannot tell submitit that a Slurm job ended (None when it answers)."""
    try:
        r = subprocess.run(
            ["sacct", "--noheader", "--allocations", "--format=JobID", "--starttime=now"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sacct did not run ({e})"
    if r.returncode == 0:
        return None
    return f"`sacct` failed: {(r.stderr or r.stdout).strip() or f'exit code {r.returncode}'}"


def require_accounting() -> None:
    """Exit 2 with one line naming the fix when Slurm accounting is off, before anything is submitted.

    submitit sees a job that died without a result only in ``sacct``; without it, it would wait forever.
    """
    why = accounting_problem()
    if why is None:
        return
    print(
        f"hlat: configuration error: hydra/launcher=slurm needs Slurm accounting, and {why}. submitit learns that a "
        "job ended without a result (scancel, out of memory, a lost node) only from sacct, so without it the sweep "
        "would wait forever for such a job. Enable accounting on the cluster (slurmdbd, and "
        "AccountingStorageType=accounting_storage/slurmdbd in slurm.conf: https://slurm.schedmd.com/accounting.html)"
        ", or run the sweep on one machine with hydra/launcher=submitit_local",
        file=sys.stderr,
    )
    raise SystemExit(2)
