"""A quiet console: the libraries' INFO chatter goes to the run's log file, not between the progress lines.

Their warnings and errors still reach the console; ``train.log`` keeps everything.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

QUIET = ("mlflow", "alembic", "huey", "sqlalchemy", "urllib3", "git", "filelock", "httpx", "botocore")
"""Top-level logger names whose INFO/DEBUG records stay off the console."""


def route_library_logs() -> None:
    """Send MLflow's (and the alembic migrations') records through the root logger's handlers.

    MLflow gives its loggers a stderr handler of its own, which no filter sees: ``MLFLOW_CONFIGURE_LOGGING=false``
    (inherited by child processes) stops ``import mlflow`` installing it; if mlflow is already imported, it is removed.
    """
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    if logging.getLogger("alembic").level == logging.NOTSET:  # its INFO is dozens of migration lines: as mlflow does
        logging.getLogger("alembic").setLevel(logging.WARNING)
    if "mlflow" not in sys.modules or os.environ["MLFLOW_CONFIGURE_LOGGING"].lower() not in ("false", "0"):
        return
    for name in ("mlflow", "alembic", "huey"):
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True
        logger.setLevel(logging.NOTSET if name == "mlflow" else logging.WARNING)


class LibraryFilter(logging.Filter):
    """Passes a record unless it is below ``level`` and comes from a logger under one of ``quiet``.

    Built by the console handler of ``conf/hydra/job_logging/hlat.yaml``; it calls :func:`route_library_logs` so
    that Hydra's logging setup, before the run imports mlflow, is enough.
    """

    def __init__(self, quiet: Sequence[str] = QUIET, level: str | int = "WARNING") -> None:
        super().__init__()
        self.quiet = frozenset(quiet)
        self.level = logging.getLevelName(level) if isinstance(level, str) else level
        route_library_logs()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` goes to the console."""
        return record.levelno >= self.level or record.name.partition(".")[0] not in self.quiet


def console_logging(fmt: str = "%(message)s", level: int = logging.INFO) -> None:
    """``logging.basicConfig`` for the commands outside Hydra (eval, doctor, data, compare), with the quiet filter."""
    logging.basicConfig(level=level, format=fmt)
    quiet = LibraryFilter()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LibraryFilter) for f in handler.filters):
            handler.addFilter(quiet)
