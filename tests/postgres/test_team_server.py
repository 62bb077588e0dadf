"""The team tracking server on PostgreSQL (``scripts/mlflow-server.sh``): runs started together all land in it, and
it lets in only its team.

Two ways runs meet a fresh PostgreSQL store: through the server (it migrated the database when it started, and
asks every request for a login), and opening a new database directly (``tracker.uri=postgresql://...``), where
hlat's advisory lock lets only the first opener migrate it.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hlat.cli import main as hlat_main
from hlat.track.spool import Spool
from tests.integration.store_race import assert_every_point_arrived, start_together
from tests.postgres.conftest import ADMIN_PASSWORD, USERS, TeamServer


def status_without_login(uri: str) -> int:
    """The HTTP status of a tracking API read without credentials."""
    try:
        with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_eight_runs_started_at_once_on_the_fresh_team_server_all_land_and_no_password_is_recorded(
    team_server: TeamServer, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven tracker processes logged in as bob (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``) and a one-job sweep
    ``python train.py -m tracker.uri=http://alice:<password>@...``: every point, the training run's params, and its
    artifacts in the server's artifact root (uploaded through the server); a request without a login is refused.
    ``hlat compare`` and ``hlat track sync`` take the password in ``--uri`` too, ``hlat eval`` in ``tracker.uri``.
    No byte of what the runs leave (run and sweep directories with ``.hydra/``, the server's store: PostgreSQL's
    files, artifacts, auth database, log) nor of their output holds a password."""
    from mlflow import MlflowClient

    assert status_without_login(team_server.uri) == 401
    host = team_server.uri.removeprefix("http://")
    with_password = f"http://alice:{USERS['alice']}@{host}"
    outputs = start_together(
        team_server.uri,
        tmp_path,
        cache_dir,
        drivers=7,
        trainings=1,
        driver_env=team_server.login("bob"),
        train_uri=with_password,
        sweep=True,
    )
    for k, v in team_server.login("admin").items():
        monkeypatch.setenv(k, v)
    assert_every_point_arrived(team_server.uri, drivers=7, trainings=1)

    client = MlflowClient(tracking_uri=team_server.uri)
    experiment = client.get_experiment_by_name("race").experiment_id
    (run,) = client.search_runs([experiment], "attributes.run_name='train-0'")
    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    on_disk = {p.name for p in (team_server.store / "artifacts").glob(f"*/{run.info.run_id}/artifacts/*")}
    assert listed and listed == on_disk
    (parent,) = client.search_runs([experiment], "tags.`hlat.sweep_overrides` != ''")
    assert parent.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id

    spooled = client.create_run(experiment, run_name="spooled").info.run_id  # what a run left in an outage
    spool = Spool(tmp_path / "mlflow-spool" / f"{spooled}.jsonl", spooled, team_server.uri)
    spool.append(0, [("train/loss", 1.0 / step, 1000 + step, step) for step in range(1, 6)])
    spool.set_meta({"status": "FINISHED", "end_time": 2000})
    spool.close()
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(k)  # from here on only the URI's login
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as synced:
        hlat_main(["track", "sync", str(spool.path), "--uri", with_password])
    with pytest.raises(SystemExit) as compared:
        hlat_main(["compare", "--uri", with_password, "--runs", run.info.run_id, spooled, "--out", str(tmp_path / "c")])
    assert synced.value.code == compared.value.code == 0 and (tmp_path / "c" / "comparison.md").is_file()
    assert [m.step for m in client.get_metric_history(spooled, "train/loss")] == [1, 2, 3, 4, 5]
    checkpoints = next(tmp_path.glob("train-0/**/checkpoints"))  # the sweep's one job
    with pytest.raises(SystemExit) as evaluated:  # its scores go to the training run, through the login in the URI
        hlat_main(["eval", f"checkpoint={checkpoints}", "tasks=local", f"tracker.uri={with_password}"])
    assert evaluated.value.code == 0 and "eval/tokens_seen" in client.get_run(run.info.run_id).data.metrics

    leaked = [
        f"{p}: {name}"
        for p in [*tmp_path.rglob("*"), *team_server.store.rglob("*")]
        if p.is_file() and not p.is_symlink()
        for name, secret in {**USERS, "admin": ADMIN_PASSWORD}.items()
        if secret.encode() in p.read_bytes()
    ]
    assert leaked == []
    assert [u for u, secret in USERS.items() if any(secret in out for out in outputs.values())] == []


def test_runs_opening_a_fresh_postgresql_database_at_once_all_land(
    team_server: TeamServer, tmp_path: Path, cache_dir: Path
) -> None:
    """Four tracker processes are enough for a race: without the lock, 7 of 8 (and 3 of 4) died in the migration."""
    uri = team_server.new_database("direct")
    start_together(uri, tmp_path, cache_dir, drivers=4, trainings=0)
    assert_every_point_arrived(uri, drivers=4, trainings=0)
