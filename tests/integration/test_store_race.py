"""Runs started together never race the store: the first opener creates and migrates a fresh store, the others wait.

MLflow migrates a new database store when a process first opens it, unguarded: eight processes opening a new sqlite
store at once died in its migration (``duplicate column name: step``, ``table _alembic_tmp_metrics already exists``)
before hlat locked the store's creation (``hlat.track.mlflow_store.open_client``).
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from pathlib import Path

import pytest

from hlat.track.mlflow_store import open_client
from tests.integration.store_race import assert_every_point_arrived, start_together
from tests.timeouts import hang_guard


@pytest.mark.slow
def test_eight_runs_started_at_once_on_a_fresh_sqlite_store_all_land(tmp_path: Path, cache_dir: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    start_together(uri, tmp_path, cache_dir, drivers=7, trainings=1)
    assert_every_point_arrived(uri, drivers=7, trainings=1)


def _open_then_set(db: Path, opened: threading.Event) -> None:
    open_client(f"sqlite:///{db}")
    opened.set()


def test_an_opener_waits_while_another_process_holds_the_store_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock is ``<db>.lock`` beside the store, taken before MLflow touches the database; once the store is
    migrated, the file names it (later openers of that very store need not queue)."""
    caplog.set_level(logging.INFO, logger="hlat.track.mlflow_store")
    db = tmp_path / "mlflow.db"
    opened = threading.Event()
    with open(f"{db}.lock", "a") as held:  # flock: another open file description, as another process would have
        fcntl.flock(held, fcntl.LOCK_EX)
        threading.Thread(target=_open_then_set, args=(db, opened), daemon=True).start()
        deadline = time.monotonic() + hang_guard(60)
        while "waiting for another process" not in caplog.text:
            assert time.monotonic() < deadline and not opened.is_set(), "opened the store without waiting"
            time.sleep(0.05)
        assert not db.exists()
    assert opened.wait(hang_guard(60))
    assert Path(f"{db}.lock").read_text().endswith(f": inode {db.stat().st_ino}\n")
