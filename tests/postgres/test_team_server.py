"""The team tracking server on PostgreSQL (``scripts/mlflow-server.sh``): runs started together all land in it.

Two ways runs meet a fresh PostgreSQL store: through the server (it migrated the database when it started), and
opening a new database directly (``tracker.uri=postgresql://...``), where hlat's advisory lock lets only the first
opener migrate it.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.store_race import assert_every_point_arrived, start_together
from tests.postgres.conftest import TeamServer


def test_eight_runs_started_at_once_on_the_fresh_team_server_all_land(
    team_server: TeamServer, tmp_path: Path, cache_dir: Path
) -> None:
    """Seven tracker processes and a ``python train.py tracker.uri=http://...``: every point, the training run's
    params, and its artifacts in the server's artifact root (uploaded through the server)."""
    from mlflow import MlflowClient

    start_together(team_server.uri, tmp_path, cache_dir, drivers=7, trainings=1)
    assert_every_point_arrived(team_server.uri, drivers=7, trainings=1)

    client = MlflowClient(tracking_uri=team_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("race").experiment_id], "attributes.run_name='train-0'")
    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    on_disk = {p.name for p in (team_server.store / "artifacts").glob(f"*/{run.info.run_id}/artifacts/*")}
    assert listed and listed == on_disk


def test_runs_opening_a_fresh_postgresql_database_at_once_all_land(
    team_server: TeamServer, tmp_path: Path, cache_dir: Path
) -> None:
    """Four tracker processes are enough for a race: without the lock, 7 of 8 (and 3 of 4) died in the migration."""
    uri = team_server.new_database("direct")
    start_together(uri, tmp_path, cache_dir, drivers=4, trainings=0)
    assert_every_point_arrived(uri, drivers=4, trainings=0)
