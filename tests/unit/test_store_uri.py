"""Which MLflow store a command uses: ``--uri`` (or ``tracker.uri=`` on its command line), else
``MLFLOW_TRACKING_URI``, else ``tracker.uri`` of the config, else ``./mlflow.db``; and each command says which on
stderr, without a password (``hlat.track.mlflow_store.resolve_store``, shared by every command that opens MLflow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.config import TrackerConfig
from hlat.track import mlflow_store as ms
from hlat.track.credentials import without_credentials

TEAM = "http://team.example:5000"
CONF = "postgresql://db.example/runs"
MINE = "sqlite:////tmp/mine.db"


def _never() -> str:
    raise AssertionError("conf/ composed although --uri or MLFLOW_TRACKING_URI decided")


@pytest.mark.parametrize(
    ("given", "env", "configured", "uri", "source"),
    [
        (MINE, TEAM, _never, MINE, "--uri"),
        (None, TEAM, _never, TEAM, "MLFLOW_TRACKING_URI"),
        (None, "", lambda: CONF, CONF, "tracker.uri in the config"),  # an empty variable is unset
        (None, None, CONF, CONF, "tracker.uri in the config"),
        (None, None, lambda: None, None, "the default: mlflow.db in the working directory"),
    ],
)
def test_the_precedence(
    given: str | None, env: str | None, configured: object, uri: str | None, source: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    environ = {} if env is None else {"MLFLOW_TRACKING_URI": env}
    store = ms.resolve_store(given, configured=configured, environ=environ)  # type: ignore[arg-type]
    assert store == ms.Store(uri or f"sqlite:///{tmp_path}/mlflow.db", source)


def test_the_line_names_store_and_source_never_the_password() -> None:
    line = ms.Store("http://alice:s3cr3t@team.example:5000", "MLFLOW_TRACKING_URI").line("hlat compare")
    assert line == "hlat compare: MLflow store http://team.example:5000 (from MLFLOW_TRACKING_URI)"
    shown = without_credentials("postgresql+psycopg://u:p@db:5432/x?sslmode=require&Password=p2")
    assert shown == "postgresql+psycopg://u@db:5432/x?sslmode=require&Password=***"  # the role stays, no password
    assert without_credentials("sqlite:////a@b/mlflow.db") == "sqlite:////a@b/mlflow.db"  # a path, not user-info


def test_a_hydra_commands_own_tracker_uri_beats_the_variable_one_from_conf_does_not(monkeypatch) -> None:
    """``tracker.uri=`` on the command line is the Hydra commands' ``--uri``; a conf file's value yields to
    MLFLOW_TRACKING_URI and is cleared, so that the run's processes (which inherit the variable) open that store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", TEAM)
    for override in (f"tracker.uri={MINE}", f"+tracker.uri={MINE}", f"++tracker.uri={MINE}"):
        tracker, store = ms.command_tracker(TrackerConfig(uri=MINE), ["model=tiny", override])
        assert (tracker.uri, store.uri, store.source) == (MINE, MINE, "tracker.uri on the command line")
        assert ms.run_store_uri(tracker.uri) == MINE
    tracker, store = ms.command_tracker(TrackerConfig(uri=CONF), ["tracker.uri_note=x", "tracker=mlflow"])
    assert (tracker.uri, store.uri, store.source) == (None, TEAM, "MLFLOW_TRACKING_URI")
    assert ms.run_store_uri(tracker.uri) == TEAM
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tracker, store = ms.command_tracker(TrackerConfig(uri=CONF), [])
    assert (tracker.uri, store.source) == (CONF, "tracker.uri in the config") and ms.run_store_uri(CONF) == CONF


def test_compare_and_eval_say_which_store_they_used(tmp_path: Path, monkeypatch, capsys) -> None:
    """Both commands resolve before any work: compare reads the variable's store (an empty one here: it says so),
    eval names its own override; neither falls back to ./mlflow.db while the variable is set."""
    from hlat.cli import main
    from hlat.track import compare

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/team.db")
    assert compare.main(["--experiment", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hlat compare: MLflow store sqlite:///{tmp_path}/team.db (from MLFLOW_TRACKING_URI)\n")
    assert f"at sqlite:///{tmp_path}/team.db" in err and not (tmp_path / "mlflow.db").exists()
    with pytest.raises(SystemExit) as done:
        main(["eval", f"tracker.uri=sqlite:///{tmp_path}/mine.db"])  # no checkpoint: refused after the line
    err = capsys.readouterr().err
    assert done.value.code == 2 and "hlat eval needs a checkpoint" in err
    assert f"hlat eval: MLflow store sqlite:///{tmp_path}/mine.db (from tracker.uri on the command line)" in err
