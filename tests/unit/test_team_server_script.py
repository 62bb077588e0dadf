"""Who ``scripts/mlflow-server.sh`` lets in: MLflow's basic-auth app whenever it binds beyond loopback, the admin
password never on a command line, and no open server beyond loopback unless asked for by name.

Tests must not bind beyond loopback, so here the script starts a stand-in ``mlflow`` that records its arguments and
environment (what the script decides is all this checks, in milliseconds); the PostgreSQL lane runs the real server
with the login on, on loopback, and shows it refusing a request without one (tests/postgres)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mlflow-server.sh"
ADMIN = "admin-pw-0123456789"
RECORDER = """#!/usr/bin/env bash
printf '%s\\n' "$@" >"$RECORD/args"
env >"$RECORD/env"
"""


def start(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str] | None, dict[str, str]]:
    """Run the script with ``env`` and a stand-in ``mlflow``; its result, the arguments and environment ``mlflow``
    got (None: it was not started)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(exist_ok=True)
    record.mkdir(exist_ok=True)
    (bin_dir / "mlflow").write_text(RECORDER)
    (bin_dir / "mlflow").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "ADMIN_", "ALLOW_"))}
    run_env = {
        **base,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "RECORD": str(record),
        "MLFLOW_STORE": str(tmp_path / "store"),
        "MLFLOW_DB_URI": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}",  # no PostgreSQL to start for this
        **env,
    }
    r = subprocess.run(["bash", str(SCRIPT)], env=run_env, capture_output=True, text=True, timeout=60, check=False)
    args = (record / "args").read_text().splitlines() if (record / "args").exists() else None
    got = dict(line.split("=", 1) for line in (record / "env").read_text().splitlines() if "=" in line) if args else {}
    return r, args, got


def test_beyond_loopback_without_a_password_it_refuses_and_names_both_fixes(tmp_path: Path) -> None:
    r, args, _ = start(tmp_path, HOST="0.0.0.0")
    assert r.returncode == 2 and args is None
    assert "ADMIN_PASSWORD_FILE=<file> or MLFLOW_AUTH_ADMIN_PASSWORD" in r.stderr
    assert "ALLOW_UNAUTHENTICATED=1" in r.stderr


@pytest.mark.parametrize("given", ["file", "environment"])
def test_beyond_loopback_with_a_password_it_runs_the_login_and_the_password_is_never_an_argument(
    tmp_path: Path, given: str
) -> None:
    secret = tmp_path / "admin-password"
    secret.write_text(ADMIN + "\n")
    how = {"ADMIN_PASSWORD_FILE": str(secret)} if given == "file" else {"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN}
    r, args, env = start(tmp_path, HOST="0.0.0.0", ALLOWED_HOSTS="mlflow.internal:5000", **how)
    assert r.returncode == 0, r.stderr
    assert args is not None and args[:2] == ["server", "--artifacts-destination"]
    assert args[args.index("--app-name") + 1] == "basic-auth" and args[args.index("--host") + 1] == "0.0.0.0"
    assert not [a for a in args if ADMIN in a or "sqlite:" in a]  # neither password nor database URI for `ps`
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == ADMIN and env["MLFLOW_BACKEND_STORE_URI"].startswith("sqlite:")
    store = tmp_path / "store"
    ini = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
    assert ini.parent == store and f"database_uri = sqlite:///{store}/basic_auth.db" in ini.read_text()
    assert "default_permission = EDIT" in ini.read_text()  # a team: every user may log into every experiment
    assert "auth_cache_ttl_seconds = 60" in ini.read_text()  # else every request costs a password hash
    key = store / "flask-secret-key"
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == key.read_text().strip()  # MLflow's CSRF key, kept
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not [p for p in store.rglob("*") if p.is_file() and ADMIN.encode() in p.read_bytes()]


def test_open_beyond_loopback_only_by_name_and_a_server_that_had_users_keeps_its_login(tmp_path: Path) -> None:
    r, args, _ = start(tmp_path, HOST="0.0.0.0", ALLOW_UNAUTHENTICATED="1")
    assert r.returncode == 0 and args is not None and "--app-name" not in args
    r, args, _ = start(tmp_path)  # loopback, nothing asked: open, as before
    assert r.returncode == 0 and args is not None and "--app-name" not in args
    (tmp_path / "store" / "basic_auth.db").touch()  # its users from an earlier start
    r, args, _ = start(tmp_path, HOST="0.0.0.0", ALLOW_UNAUTHENTICATED="1")
    assert r.returncode == 0 and args is not None and "basic-auth" in args
