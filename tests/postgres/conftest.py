"""Fixtures of the PostgreSQL lane: the team tracking server, ``scripts/mlflow-server.sh``, on a real PostgreSQL.

The script starts PostgreSQL (Debian's package) in a temporary directory and MLflow's server on it, as a team would,
with MLflow's login on (an admin password file; the admin adds two team members); the tests run against that. The
main suite leaves the lane out: it is collected only with ``HLAT_POSTGRES_LANE=1`` (``make test-postgres``, which
installs PostgreSQL and the ``team`` extra first).
"""

from __future__ import annotations

import base64
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.mlflow_ui import free_port
from tests.timeouts import hang_guard

if os.environ.get("HLAT_POSTGRES_LANE") != "1":
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mlflow-server.sh"


ADMIN_PASSWORD = f"admin-{secrets.token_hex(8)}"
USERS = {"alice": f"alice-{secrets.token_hex(8)}", "bob": f"bob-{secrets.token_hex(8)}"}
"""The team server's admin password (from a file) and its team members', new each session: the lane greps what the
runs leave for them, and a constant would be found in any uncommitted diff of this file (a run's git.diff)."""


@dataclass(frozen=True)
class TeamServer:
    """The running team server: its address, the directory the script keeps everything in, the admin's password
    file (outside it)."""

    uri: str
    store: Path
    admin_password_file: Path

    @staticmethod
    def login(user: str = "admin") -> dict[str, str]:
        """The environment of a client logged in as ``user`` (MLflow's variables)."""
        password = ADMIN_PASSWORD if user == "admin" else USERS[user]
        return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}

    @property
    def pg_bin(self) -> Path:
        """The PostgreSQL programs the script runs (the newest installed)."""
        return Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])

    def new_database(self, name: str) -> str:
        """A new, empty database beside the server's, on the script's PostgreSQL: its SQLAlchemy URI."""
        socket_dir = self.store / "postgres"
        subprocess.run([self.pg_bin / "createdb", "-h", socket_dir, "-U", "mlflow", name], check=True)
        return f"postgresql://mlflow@/{name}?host={socket_dir}"


def _unavailable() -> str | None:
    """Why the lane cannot run here (None: it can)."""
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return "PostgreSQL is not installed (tests/postgres/install.sh: apt-get install postgresql)"
    try:
        import flask_wtf  # noqa: F401  (MLflow's basic-auth app: the team server's login)
        import psycopg  # noqa: F401
    except ImportError as e:
        return f"the {e.name} package is not installed (pip install -c constraints.txt -e '.[team]')"
    return None


def _add_users(uri: str) -> None:
    """The admin adds the team's members (MLflow's users API, basic auth)."""
    admin = base64.standard_b64encode(f"admin:{ADMIN_PASSWORD}".encode()).decode()
    for user, password in USERS.items():
        request = urllib.request.Request(
            f"{uri}/api/2.0/mlflow/users/create",
            data=json.dumps({"username": user, "password": password}).encode(),
            headers={"Authorization": f"Basic {admin}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=hang_guard(30)):
            pass


def _wait_healthy(uri: str, server: subprocess.Popen, log: Path) -> None:
    """Wait until the server answers ``/health``; fail with its log if the script ends first or it never does."""
    deadline = time.monotonic() + hang_guard(180)
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"scripts/mlflow-server.sh exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the team server did not answer within the hang guard:\n{log.read_text()[-3000:]}")


class ScriptServer:
    """``scripts/mlflow-server.sh`` on a database that exists (``MLFLOW_DB_URI``), in its own process group: the
    MLflow server of the team setup, which :meth:`kill` SIGKILLs while its PostgreSQL keeps running."""

    def __init__(self, db_uri: str, store: Path) -> None:
        self.db_uri, self.store, self.port = db_uri, store, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ScriptServer:
        """Start the script (on the same database, artifact root and port every time) and wait until it answers."""
        env = {
            **os.environ,
            "MLFLOW_DB_URI": self.db_uri,
            "MLFLOW_STORE": str(self.store),
            "PORT": str(self.port),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this venv's mlflow
        }
        log = self.store / "server.log"
        with open(log, "a") as out:
            self.proc = subprocess.Popen(
                ["bash", str(SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        _wait_healthy(self.uri, self.proc, log)
        return self

    def kill(self) -> None:
        """SIGKILL the script, MLflow's server and its worker (their process group): no goodbye, as a crashed host."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(hang_guard(60))


@pytest.fixture(scope="session")
def team_server() -> Iterator[TeamServer]:
    """``scripts/mlflow-server.sh`` on a free loopback port, its PostgreSQL and artifacts in a fresh directory.

    After the session the script is stopped as Ctrl-C would, and must have stopped its PostgreSQL.
    """
    why = _unavailable()
    if why:
        pytest.fail(f"the PostgreSQL lane cannot run here: {why}")
    # Under /tmp, short: the postgres user (the script runs PostgreSQL as it under root) must reach the directory,
    # and the socket's path must stay under 108 characters.
    store = Path(tempfile.mkdtemp(prefix="hlat-pg-", dir="/tmp"))
    store.chmod(0o755)
    keys = Path(tempfile.mkdtemp(prefix="hlat-pg-admin-"))  # not in the store: the lane greps the store for it
    (keys / "admin-password").write_text(ADMIN_PASSWORD + "\n")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "MLFLOW_STORE": str(store),
        "PORT": str(port),
        "ADMIN_PASSWORD_FILE": str(keys / "admin-password"),  # the login, on loopback too
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this venv's mlflow
    }
    log = store / "server.log"
    with open(log, "w") as out:
        # With SIGINT at its default: a background job of a non-interactive shell (.ci/run's lanes) starts with it
        # ignored, and a bash script cannot trap a signal ignored at its start, so Ctrl-C below would do nothing.
        server = subprocess.Popen(
            ["bash", str(SCRIPT)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        _wait_healthy(uri, server, log)
        _add_users(uri)
        yield TeamServer(uri, store, keys / "admin-password")
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends it
        server.wait(timeout=hang_guard(120))
        assert not (store / "postgres" / "postmaster.pid").exists(), "the script left PostgreSQL running"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        pid_file = store / "postgres" / "postmaster.pid"
        if pid_file.exists():  # the script failed to stop it: stop it here, so nothing outlives the lane
            postmaster = int(pid_file.read_text().split()[0])
            os.kill(postmaster, signal.SIGQUIT)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(keys, ignore_errors=True)


@pytest.fixture(scope="module")
def script_server(team_server: TeamServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptServer]:
    """A second team server, running, on a new database of the lane's PostgreSQL: one per test module."""
    name = tmp_path_factory.mktemp("db").name.replace("-", "_")  # unique in the session
    server = ScriptServer(team_server.new_database(name), tmp_path_factory.mktemp("script-server")).start()
    yield server
    if server.running:
        server.kill()  # its data is in PostgreSQL; a graceful stop took ~15 s here for nothing
