"""Runs started together on one fresh MLflow store: hlat trackers in real processes, released at one instant, and
``python train.py`` beside them; every job's points counted afterwards (used by the sqlite test and the PostgreSQL
lane, tests/postgres)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "race"
STEPS = 40
"""Steps each driver logs; three metrics a step."""
TRAIN_STEPS = 3
TINY_TRAIN = [
    "model.n_layers=1",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    f"train.steps={TRAIN_STEPS}",
    "train.log_every=1",
    "train.checkpoint_every=1000",
    "train.async_checkpoint=false",
    "optimizer.warmup_steps=1",
    "tracker.plots=false",
    "tracker.system_metrics=false",
    "tracker.flush_every_s=0",
    f"tracker.experiment={EXPERIMENT}",
    "health=off",
]
"""A training run of a few seconds on 2 CPU cores."""

DRIVER = f"""
import os, sys, time, traceback
from pathlib import Path
import mlflow  # imported once, before the fork: each driver process then only opens the store and logs
from hlat.config import TrackerConfig
from hlat.track.trackers import build_tracker

uri, go, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])


def drive(name):
    while not go.exists():  # every driver opens the store within milliseconds of the others
        time.sleep(0.005)
    cfg = TrackerConfig(uri=uri, experiment="{EXPERIMENT}", flush_every_s=0.2, system_metrics=False)
    tracker, _ = build_tracker(cfg, rank=0, run_name=name, tags={{}}, extra=[])
    for step in range(1, {STEPS} + 1):
        tracker.log_metrics([(step, {{"train/loss": 10.0 / step, "train/lr": 1e-4, "grad_norm": 1.0}})])
    tracker.finish()


children = {{}}
for i in range(count):
    pid = os.fork()
    if pid == 0:
        try:
            drive(f"driver-{{i}}")
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    children[pid] = f"driver-{{i}}"
print("ready", flush=True)
failed = [name for pid, name in children.items() if os.waitpid(pid, 0)[1] != 0]
print(f"{{len(failed)}} of {{count}} drivers failed: {{' '.join(failed)}}", flush=True)
sys.exit(1 if failed else 0)
"""
"""One process that forks ``count`` drivers, each a process of its own with its own MLflow tracker, after importing
mlflow once (what a process pays before it opens the store does not matter to the race, only when it opens it)."""


def start_together(
    uri: str,
    workdir: Path,
    cache_dir: Path,
    *,
    drivers: int,
    trainings: int,
    driver_env: dict[str, str] | None = None,
    train_uri: str | None = None,
    sweep: bool = False,
) -> dict[str, str]:
    """Start ``trainings`` ``python train.py`` and ``drivers`` tracker processes on store ``uri``, release the
    drivers at once, and wait for all of them.

    ``driver_env``: more environment for the drivers; ``train_uri``: the ``tracker.uri`` the trainings are given
    (default ``uri``); ``sweep``: each training is a one-job multirun (``-m``, its directory ``hydra.sweep.dir``).

    Returns:
        Each process's output (stdout and stderr): ``train-<i>``, ``drivers``.

    Raises:
        AssertionError: A process failed; its output tail says why.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    go = workdir / "go"
    procs: dict[str, subprocess.Popen[str]] = {}
    for i in range(trainings):
        where = f"hydra.{'sweep' if sweep else 'run'}.dir={workdir / f'train-{i}'}"
        args = [*TINY_TRAIN, f"tracker.uri={train_uri or uri}", f"data.cache_dir={cache_dir}", where]
        procs[f"train-{i}"] = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *(["-m"] if sweep else []), *args, f"tracker.run_name=train-{i}"],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    procs["drivers"] = subprocess.Popen(
        [sys.executable, "-c", DRIVER, uri, str(go), str(drivers)],
        env={**env, **(driver_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its forked drivers with it: killed as a group if the test fails
    )
    deadline = time.monotonic() + hang_guard(600)
    try:
        pipe = procs["drivers"].stdout
        assert pipe is not None
        line = pipe.readline()
        assert line.strip() == "ready", line + pipe.read()[-3000:]
        go.touch()  # every driver opens the store now
        failed, outputs = {}, {"drivers": line}
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs[name] = outputs.get(name, "") + out
            if proc.returncode != 0:
                failed[name] = out[-3000:]
        assert not failed, "\n".join(f"{k} failed: {v}" for k, v in failed.items())
        return outputs
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                if name == "drivers":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait()


def assert_every_point_arrived(uri: str, *, drivers: int, trainings: int) -> None:
    """Every run of :func:`start_together` FINISHED in the store with all its points: none lost, none doubled."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id], max_results=100)
    runs = {r.info.run_name: r for r in found if "hlat.sweep_overrides" not in r.data.tags}  # not a sweep's parent
    expected = {f"driver-{i}" for i in range(drivers)} | {f"train-{i}" for i in range(trainings)}
    assert set(runs) == expected
    for name, run in runs.items():
        assert run.info.status == "FINISHED", name
        steps = STEPS if name.startswith("driver-") else TRAIN_STEPS
        loss = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in loss) == list(range(1, steps + 1)), name
        if name.startswith("driver-"):
            for key in ("train/lr", "grad_norm"):
                assert len(client.get_metric_history(run.info.run_id, key)) == STEPS, (name, key)
        else:
            assert run.data.params.get("train.steps") == str(TRAIN_STEPS), name
