"""The Hydra callbacks of ``python train.py`` (``hydra.callbacks`` in ``conf/config.yaml``).

:class:`CredentialsCallback`, of every run: a tracking URI's user name and password from the config (a config
file, an interpolation) go into the environment before Hydra writes ``.hydra/``.

:class:`SweepCallback`, of every multirun: at the start, the MLflow parent run and hlat's launcher; at the end, the
comparison and summary on the parent run, and exit 1 naming any job that failed, was killed or stopped. However it
ends, the parent run is never left RUNNING. Only rank 0 acts.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hlat.track import sweep

log = logging.getLogger(__name__)


def _uri(config: DictConfig, *, say: bool = False) -> str | None:
    """The sweep's MLflow store, as its jobs resolve it, or None when it does not track to MLflow (or only plans).

    ``say``: print on stderr which store it is and why (``hlat.track.mlflow_store.Store.line``).
    """
    from hlat.track.mlflow_store import command_store

    tracker = config.get("tracker", {})
    if tracker.get("kind") != "mlflow" or config.get("train", {}).get("dry_run"):
        return None
    store = command_store(tracker.get("uri"), list(config.hydra.overrides.task))
    if say:
        print(store.line("hlat sweep"), file=sys.stderr)
    return store.uri


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals that end a sweep between jobs through ``SystemExit`` (so the parent run is closed on the way out);
during a job the trainer takes them over and stops with a checkpoint (``hlat.launch.preempt``)."""


def _exit_on_signal(signum: int, frame: Any) -> None:
    os.write(2, f"hlat: sweep stopped by {signal.Signals(signum).name}\n".encode())
    raise SystemExit(128 + signum)


def _logs(job_dir: Path, record: dict[str, Any]) -> list[str]:
    """Where a job's output is: its ``train.log`` and what its launcher recorded (submitit's stdout and stderr)."""
    return [str(job_dir / "train.log"), *record.get("logs", [])]


def _close_job_runs(uri: str, undone: dict[Path, dict[str, Any]]) -> None:
    """Mark the MLflow runs of jobs that died without closing them KILLED or FAILED; a rerun continues them."""
    from hlat.track.mlflow_store import open_client

    client = open_client(uri)
    for job_dir, record in undone.items():
        run_id = record.get("mlflow_run_id")
        try:
            if run_id and client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED" if record.get("status") == "failed" else "KILLED")
        except Exception:  # the sweep fails anyway; a run that cannot be closed must not hide why
            log.exception("could not close the MLflow run %s of job %s", run_id, job_dir)


class SweepCallback(Callback):
    """MLflow parent run, comparison report and failure summary of a Hydra multirun."""

    def __init__(self) -> None:
        self._open: tuple[str, str, Path] | None = None
        """(uri, parent run id, sweep dir) from the sweep's start until its parent run is terminated."""
        self._handlers: dict[int, Any] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hlat.sweep import launcher as sweep_launcher

        sweep_launcher.adopt(config)  # the plugin's submitit launchers -> hlat's: a dead job does not crash the sweep
        if config.hydra.launcher.get("_target_") == f"{sweep_launcher.OURS}SlurmLauncher":
            sweep_launcher.require_accounting()  # before the parent run: never a sweep that cannot see a job die
        uri = _uri(config, say=sweep.rank() == 0)
        if sweep.rank() != 0 or uri is None:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not (sweep_dir / sweep.SWEEP_FILE).exists():  # else this sweep started before (a restarted launcher)
            self._create_parent(config, uri, sweep_dir)
        self._open = (uri, json.loads((sweep_dir / sweep.SWEEP_FILE).read_text())["parent_run_id"], sweep_dir)
        atexit.register(self._close_interrupted)
        for s in STOP_SIGNALS:
            try:
                self._handlers[s] = signal.signal(s, _exit_on_signal)
            except ValueError:  # not the main thread
                break

    @staticmethod
    def _create_parent(config: DictConfig, uri: str, sweep_dir: Path) -> None:
        """Open the sweep's MLflow parent run and record it in ``sweep.json``."""
        from hlat.track.mlflow_store import open_client
        from hlat.track.trackers import experiment_id as get_experiment

        client = open_client(uri)
        name = config.tracker.experiment
        experiment_id = get_experiment(client, name)
        overrides = " ".join(config.hydra.overrides.task)
        run = client.create_run(
            experiment_id,
            run_name=f"sweep {sweep_dir.name}",
            tags={
                "hlat.sweep_dir": str(sweep_dir.resolve()),
                "hlat.sweep_overrides": overrides[:5000],
                "mlflow.note.content": f"Hydra multirun `{config.hydra.job.config_name}` {overrides}"[:5000],
            },
        )
        (sweep_dir / sweep.SWEEP_FILE).write_text(
            json.dumps(
                {
                    "parent_run_id": run.info.run_id,
                    "experiment": name,
                    "uri": uri,
                    "overrides": list(config.hydra.overrides.task),
                },
                indent=2,
            )
            + "\n"
        )
        log.info("sweep %s: MLflow parent run %s in experiment %r", sweep_dir, run.info.run_id, name)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if sweep.rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        records = sweep.job_records(sweep_dir)
        # Not done: failed here, killed or cancelled outside (sweep_launcher records those), stopped by a signal.
        undone = {d: r for d, r in records.items() if r.get("status") not in sweep.DONE}
        counts = {s: sum(r.get("status") == s for r in records.values()) for s in (*sweep.DONE, "failed")}
        counts["killed or stopped"] = len(undone) - counts["failed"]
        print(f"hlat: sweep {sweep_dir}: {len(records)} jobs, " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        parent = (
            json.loads((sweep_dir / sweep.SWEEP_FILE).read_text()) if (sweep_dir / sweep.SWEEP_FILE).exists() else None
        )
        uri = _uri(config)
        if uri is not None:
            _close_job_runs(uri, undone)
        if uri is not None and sweep.recorded_run_ids(sweep_dir):
            self._compare(uri, sweep_dir, parent)
        if parent is not None:
            from hlat.track.mlflow_store import open_client

            status = "FAILED" if counts["failed"] else "KILLED" if undone else "FINISHED"
            open_client(uri).set_terminated(parent["parent_run_id"], status)
        self._release()
        if undone:
            jobs = "; ".join(
                f"{d.name} {r.get('status', 'killed')} (logs: {', '.join(_logs(d, r))})" for d, r in undone.items()
            )
            print(
                f"hlat: {len(undone)} of {len(records)} jobs did not finish: {jobs}. Fix the cause and run the same "
                "command again: finished jobs are skipped and the others continue from their newest checkpoint",
                file=sys.stderr,
            )
            raise SystemExit(1)  # Hydra turns a callback's exceptions into warnings; the sweep must fail

    def _release(self) -> None:
        """The sweep ended normally: nothing to close at exit; the signal handlers go back."""
        self._open = None
        for s, handler in self._handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._handlers.clear()

    def _close_interrupted(self) -> None:
        """At exit, if the sweep did not end normally: mark its parent run KILLED (never left RUNNING)."""
        if self._open is None:
            return
        uri, parent_run_id, sweep_dir = self._open
        self._open = None
        try:
            from hlat.track.mlflow_store import open_client

            client = open_client(uri)
            client.set_tag(parent_run_id, "hlat.interrupted", "true")
            client.set_terminated(parent_run_id, "KILLED")
        except Exception:  # exiting anyway: report, never raise from atexit
            log.exception("could not mark the parent run %s of sweep %s KILLED", parent_run_id, sweep_dir)
            return
        print(
            f"hlat: sweep {sweep_dir} interrupted: its MLflow parent run {parent_run_id} is KILLED. Run the same "
            "command again to continue: finished jobs are skipped, the others continue from their checkpoints",
            file=sys.stderr,
        )

    @staticmethod
    def _compare(uri: str, sweep_dir: Path, parent: dict[str, Any] | None) -> None:
        """``hlat compare --sweep`` over this sweep, then the parent run's summary (failures: logged)."""
        from hlat.track.compare import COMPARED, digested, summary_table, write_report
        from hlat.track.credentials import without_credentials
        from hlat.track.mlflow_store import open_client
        from hlat.track.runs import select_runs
        from hlat.track.sweep_views import summarize
        from hlat.track.trackers import ui_address

        client = open_client(uri)
        try:
            runs = select_runs(uri, sweep_dir=str(sweep_dir), status=None, keys=COMPARED, reduce=digested)
            md, png = write_report(runs, sweep_dir, title=f"Sweep {sweep_dir}: {len(runs)} MLflow runs")
            print(summary_table(runs))
            again = f"hlat compare --sweep {sweep_dir} --uri {without_credentials(uri)}"
            print(f"\ncomparison: {md}\nplot:       {png}\nagain:      {again}")
            if parent is not None:
                for f in (md, png):
                    client.log_artifact(parent["parent_run_id"], str(f))
        except Exception:
            log.exception("could not compare the runs of sweep %s", sweep_dir)
            return
        if parent is None:
            return
        try:
            page = summarize(client, parent["parent_run_id"], runs, sweep_dir.name)
            print(f"MLflow:     {ui_address(uri, page)}")
        except Exception:  # the UI's conveniences: the sweep and its comparison stand without them
            log.exception("could not summarize sweep %s on its MLflow parent run", sweep_dir)


class CredentialsCallback(Callback):
    """A ``tracker.uri`` with a user name and password in the composed config: they move to the environment.

    The command line's are gone before Hydra starts (``hlat.cli.run_hydra``); a URI from a config file or an
    interpolation is handled here, after composition and before Hydra writes ``.hydra/``. A single run's config is
    changed in place (Hydra saves and runs that very object); a multirun's jobs are composed again from the files, so
    they get the URI without credentials as one more override.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _take_credentials(config, multirun=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _take_credentials(config, multirun=True)


def _take_credentials(config: DictConfig, *, multirun: bool) -> None:
    from hlat.config import ConfigError
    from hlat.track.credentials import adopt, has_credentials

    uri = OmegaConf.select(config, "tracker.uri", default=None)
    if not isinstance(uri, str) or not has_credentials(uri):
        return
    try:
        clean = adopt(uri)
    except ConfigError as e:  # Hydra turns a callback's exceptions into warnings: this one must stop the run
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    with read_write(config), open_dict(config):
        config.tracker.uri = clean
        if multirun:
            quoted = clean.replace("\\", "\\\\").replace("'", "\\'")
            config.hydra.overrides.task.append(f"tracker.uri='{quoted}'")
