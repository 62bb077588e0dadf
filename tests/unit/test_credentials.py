"""A tracking store's credentials leave the URI before anything records it (``hlat.track.credentials``): they go to
the variables MLflow's and libpq's clients read, and every way a URI reaches hlat (the command line of
``python train.py``, ``hlat ...``, a config file, an interpolation, ``MLFLOW_TRACKING_URI``, a multirun) records it
without them. The PostgreSQL lane trains through an authenticating server this way (tests/postgres)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hlat import cli
from hlat.config import ConfigError, TrackerConfig
from hlat.track import credentials
from hlat.track.credentials import PASSWORD, PG_PASSWORD, TOKEN, USERNAME, adopt, adopt_arguments, auth_header

ROOT = Path(__file__).resolve().parents[2]
SECRET = "pw-of-alice:with@signs"
URI = "http://alice:pw-of-alice%3Awith%40signs@127.0.0.1:5999"
"""A password with ``:`` and ``@`` (percent-encoded in the URI, as a URI must hold them)."""
VARS = (USERNAME, PASSWORD, TOKEN, PG_PASSWORD, "MLFLOW_TRACKING_URI")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The process environment without any credential variable; restored after the test."""
    for k in VARS:
        monkeypatch.setenv(k, "")  # recorded, so that whatever the test sets is removed again
        monkeypatch.delenv(k)
    return os.environ  # type: ignore[return-value]


def test_adopt_moves_the_user_and_password_into_the_variables_the_clients_read(env: dict[str, str]) -> None:
    assert adopt(URI) == "http://127.0.0.1:5999"
    assert (env[USERNAME], env[PASSWORD]) == ("alice", SECRET)
    assert adopt("https://alice:pw-of-alice%3Awith%40signs@mlflow.internal/prefix?x=1") == (
        "https://mlflow.internal/prefix?x=1"  # the same again: no clash
    )
    assert adopt("http://mlflow.internal:5000") == "http://mlflow.internal:5000"  # nothing to take: unchanged
    # PostgreSQL: a role alone is no secret (the lane's own store); a password goes to libpq's variable
    assert adopt("postgresql://mlflow@/direct?host=/tmp/pg") == "postgresql://mlflow@/direct?host=/tmp/pg"
    assert PG_PASSWORD not in env
    assert (
        adopt("postgresql+psycopg://mlflow:db-pw@db.internal/mlflow")
        == "postgresql+psycopg://mlflow@db.internal/mlflow"
    )
    assert env[PG_PASSWORD] == "db-pw"
    header = auth_header()
    assert header is not None and header.startswith("Basic ")


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("http://token-only@h:5000", "names a user without a password"),
        ("http://alice:@h:5000", "names a user without a password"),
        ("mysql://u:secret@db/mlflow", "no way to hand a mysql driver its password"),
        ("http://bob:other@h:5000", f"differ from {USERNAME} and {PASSWORD} in the environment"),
    ],
)
def test_adopt_refuses_what_it_cannot_hand_over_and_never_shows_it(env: dict[str, str], uri: str, why: str) -> None:
    env.update({USERNAME: "alice", PASSWORD: SECRET})
    with pytest.raises(ConfigError, match=why) as e:
        adopt(uri)
    assert "secret" not in str(e.value) and "other" not in str(e.value) and "token-only" not in str(e.value)
    assert env[USERNAME] == "alice"


def test_the_arguments_that_name_a_store_lose_their_credentials_and_no_other_does(env: dict[str, str]) -> None:
    args = [
        f"tracker.uri={URI}",
        f"++tracker.uri={URI},http://alice:pw-of-alice%3Awith%40signs@other:5000",  # a sweep of two servers
        "--uri",
        URI,
        f"--uri={URI}",
        "data.path=http://x:y@not-a-store/file",  # not a store: hlat hands it to nobody, so it stays as given
    ]
    assert adopt_arguments(args) == [
        "tracker.uri=http://127.0.0.1:5999",
        "++tracker.uri=http://127.0.0.1:5999,http://other:5000",
        "--uri",
        "http://127.0.0.1:5999",
        "--uri=http://127.0.0.1:5999",
        "data.path=http://x:y@not-a-store/file",
    ]
    assert env[PASSWORD] == SECRET


def test_mlflow_tracking_uri_and_every_hlat_command_line_lose_them_before_the_command_runs(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env["MLFLOW_TRACKING_URI"] = URI
    seen: list[list[str]] = []
    monkeypatch.setattr("hlat.track.compare.main", lambda argv: seen.append(argv) or 0)
    with pytest.raises(SystemExit):
        cli.main(["compare", "--uri", URI, "--experiment", "x"])
    assert seen == [["--uri", "http://127.0.0.1:5999", "--experiment", "x"]]
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5999" and env[PASSWORD] == SECRET
    # hlat launch writes its overrides into files a job reads later, elsewhere: refused, and nothing set
    env.pop(PASSWORD)
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--target", "slurm", f"tracker.uri={URI}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "launch files would record" in err and PASSWORD in err and "pw-of" not in err
    assert PASSWORD not in env


def test_a_config_that_still_holds_them_is_refused_before_anything_records_it() -> None:
    for uri in (URI, "postgresql://mlflow:db-pw@db/mlflow"):
        with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD .* PGPASSWORD"):
            TrackerConfig(uri=uri)
    assert TrackerConfig(uri="postgresql://mlflow@/mlflow?host=/tmp/pg").uri  # a role, no password: taken as is
    assert credentials.without_credentials(f"see {URI}/x") == "see http://127.0.0.1:5999/x"


def test_the_reachability_check_names_a_login_the_server_refuses(env: dict[str, str]) -> None:
    """Before anything is built: a server that answers ``/health`` (MLflow's needs no login) but 401s the tracking
    API without the right ``Authorization`` stops the run with the variables to set. A few lines of HTTP stand in
    for MLflow's login here; the PostgreSQL lane shows MLflow's own 401 (tests/postgres/test_team_server.py)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from hlat.track.mlflow_store import check_reachable

    env.update({USERNAME: "alice", PASSWORD: SECRET})
    good = auth_header()
    asked: list[str | None] = []

    class Login(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.headers.get("Authorization"))
            ok = self.path == "/health" or self.headers.get("Authorization") == good
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Login)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = TrackerConfig(uri=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        check_reachable(cfg)  # the right login: nothing to say
        assert asked == [None, good]
        env[PASSWORD] = "wrong-password"
        with pytest.raises(ConfigError, match=f"refused the login in {USERNAME} and {PASSWORD} \\(HTTP 401\\)"):
            check_reachable(cfg)
        env.pop(USERNAME)
        env.pop(PASSWORD)
        with pytest.raises(ConfigError, match=f"asks for a login \\(HTTP 401\\); set {USERNAME} and {PASSWORD}"):
            check_reachable(cfg)
    finally:
        server.shutdown()
        server.server_close()


HYDRA_APP = """
import json, os, sys
from pathlib import Path
import hydra
from hlat.cli import job_started, run_hydra
from hlat.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path=sys.argv.pop(1), config_name="config")
def main(cfg):
    job_started()
    Path(cfg.data.cache_dir).mkdir(parents=True, exist_ok=True)
    seen = {"uri": cfg.tracker.uri, "user": os.environ.get("MLFLOW_TRACKING_USERNAME")}
    (Path(cfg.data.cache_dir) / f"seen-{cfg.train.seed}.json").write_text(json.dumps(seen))


run_hydra(main)
"""
"""``python train.py`` with a task that only reports what it was given: Hydra, hlat's conf/ and callbacks, the
run directory and ``.hydra/`` as a run has them, in a second, without training."""


def hydra_run(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    team = tmp_path / "team" / "tracker"  # a team's config group: its server, with a password in it
    team.mkdir(parents=True, exist_ok=True)
    (team / "team.yaml").write_text(f"defaults:\n  - mlflow\n  - _self_\nname: team\nuri: {URI}\n")
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    return subprocess.run(
        [sys.executable, "-c", HYDRA_APP, str(ROOT / "conf"), *overrides, f"data.cache_dir={tmp_path / 'seen'}"],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize(
    "how",
    ["command line", "interpolation", "config file, multirun"],
)
def test_no_file_hydra_or_hlat_writes_holds_the_password(tmp_path: Path, how: str) -> None:
    """The password given three ways: the run (a multirun's job, composed again from the files) gets the URI without
    it and the user in the environment; no byte of ``.hydra/``, ``multirun.yaml``, the log or the output holds it."""
    if how == "command line":
        r = hydra_run(tmp_path, f"tracker.uri={URI}", f"hydra.run.dir={tmp_path / 'run'}")
    elif how == "interpolation":
        r = hydra_run(
            tmp_path, "tracker.uri=${oc.env:TEAM_URI}", f"hydra.run.dir={tmp_path / 'run'}", env={"TEAM_URI": URI}
        )
    else:
        search = f"hydra.searchpath=[file://{tmp_path / 'team'}]"
        sweep = ("train.seed=7", f"hydra.sweep.dir={tmp_path / 'run'}", "tracker.kind=console")  # no parent run
        r = hydra_run(tmp_path, "-m", search, "tracker=team", *sweep)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = sorted((tmp_path / "seen").glob("seen-*.json"))
    assert len(seen) == 1
    for f in seen:
        assert f.read_text() == '{"uri": "http://127.0.0.1:5999", "user": "alice"}'
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len([p for p in written if p.parent.name == ".hydra"]) == 3 * len(seen)
    for secret in (b"pw-of-alice", b"with%40signs"):
        assert [p for p in written if secret in p.read_bytes()] == []
        assert secret.decode() not in r.stdout + r.stderr
