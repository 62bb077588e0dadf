"""Where hlat's MLflow data lives and how it is shown: the store's URI and its check, experiments, UI addresses.

mlflow itself is imported only inside the functions that need it.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, TrackerConfig


def default_uri() -> str:
    """A sqlite store ``mlflow.db`` in the working directory (``mlflow ui`` opens it from there)."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


_SERVER_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
"""Default ports of the ``tracker.uri`` schemes whose server :func:`check_reachable` asks."""


def check_reachable(cfg: TrackerConfig, *, rank: int = 0, timeout_s: float = 3.0) -> None:
    """Fail fast, before any data or model is built, when the MLflow store of ``tracker.uri`` cannot be used.

    A server gets one ``GET /health`` or TCP connect of at most ``timeout_s`` (MLflow would retry for minutes); a
    sqlite or ``file:`` store's directory must be writable. Only rank 0 checks.

    Raises:
        ConfigError: The server does not answer or the store cannot be written; names ``tracker.uri`` and the fixes.
    """
    if rank != 0 or cfg.kind != "mlflow":
        return
    from urllib.parse import urlsplit

    uri = cfg.uri or default_uri()
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+")[0].lower()  # postgresql+psycopg2 -> postgresql
    shown = uri.replace(f":{parts.password}@", ":***@") if parts.password else uri  # never print a password
    fixes = (
        "fix tracker.uri, drop it (the local store ./mlflow.db) or use tracker=console"
        if cfg.uri
        else "run from a writable directory, set tracker.uri to a writable store or use tracker=console"
    )
    if scheme in _SERVER_PORTS:
        host, port = parts.hostname or "localhost", parts.port or _SERVER_PORTS[scheme]
        error = _http_error(uri, timeout_s) if scheme.startswith("http") else _connect_error(host, port, timeout_s)
        if error is not None:
            start = f"mlflow server --host {host} --port {port}" if scheme.startswith("http") else "the database"
            raise ConfigError(
                f"tracker.uri={shown}: nothing answers at {host}:{port} within {timeout_s:g} s "
                f"({error}); start the server ({start}), {fixes}"
            )
        return
    if scheme == "sqlite":
        db = uri.removeprefix("sqlite:///")
        if db in ("", ":memory:") or db == uri:
            return
        problem = _store_dir_problem(Path(db).parent, create=False)
    elif scheme in ("file", ""):
        problem = _store_dir_problem(Path(parts.path if scheme == "file" else uri).expanduser(), create=True)
    else:
        return
    if problem is not None:
        raise ConfigError(f"tracker.uri={uri}: {problem}; {fixes}")


def _http_error(uri: str, timeout_s: float) -> str | None:
    """Why ``GET <uri>/health`` got no HTTP answer at all (None: it got one, whatever its status)."""
    import ssl
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:  # an answer: an auth proxy, an old server without /health
        return None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLError):  # a certificate MLflow may be told to accept: its business
            return None
        return str(getattr(e.reason, "strerror", None) or e.reason)
    except (OSError, ValueError) as e:  # TimeoutError, a reset connection, a malformed URL
        return str(e) or type(e).__name__


def _connect_error(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connect to ``host:port`` failed (None: it succeeded)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _store_dir_problem(where: Path, *, create: bool) -> str | None:
    """Why the local store directory ``where`` cannot be used (None: it can); ``create``: MLflow makes it if absent."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if probe != where and not create:
        return f"the directory {where} does not exist (the sqlite store does not create it)"
    try:  # a real write: permissions, read-only mounts and pseudo filesystems alike
        with tempfile.TemporaryFile(dir=probe, prefix=".hlat-write-test-"):
            pass
    except OSError as e:
        return f"cannot write into {probe} ({e.strerror or e})"
    return None


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag MLflow's UI reads for the kind of an experiment (mlflow/server/js: ``ExperimentKind``)."""
MODEL_TRAINING = "custom_model_development"
"""Its value for model training: the UI's "Machine learning" kind (the other is ``genai_development``)."""
UI_QUERY = "workflowType=machine_learning"
"""MLflow 3.17's UI shows every experiment the way its "GenAI / Model training" switch says, GenAI unless the user
changed it (its localStorage), whatever the experiment's tag; this query parameter on a page's address selects
"Model training": the runs, their charts and the compare view rather than traces. hlat puts it on the addresses it
prints."""
LOSS = "train/loss"


def experiment_id(client: Any, name: str) -> str:
    """The id of MLflow experiment ``name``, created if need be, tagged as model training unless it has a kind."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        except MlflowException as e:  # created meanwhile by another process (a sweep's parallel jobs)
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise e from None
    if EXPERIMENT_KIND_TAG not in exp.tags and exp.lifecycle_stage == "active":  # a deleted one: create_run says so
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return exp.experiment_id


def ui_page(experiment: str, run_id: str | None = None, **query: str) -> str:
    """The MLflow UI page (its ``#/...`` part) of an experiment's runs or of one run, in the model-training view.

    ``query``: more parameters for the page, e.g. ``compareRunsMode="CHART"`` (the runs' charts).
    """
    from urllib.parse import urlencode

    page = f"#/experiments/{experiment}/runs" + (f"/{run_id}" if run_id else "")
    return f"{page}?{UI_QUERY}" + (f"&{urlencode(query)}" if query else "")


def ui_address(uri: str, page: str) -> str:
    """Where to open ``page`` (:func:`ui_page`) for a run in store ``uri``: a server's own UI, or ``mlflow ui``."""
    if uri.startswith(("http://", "https://")):  # a tracking server: its UI is at the same address
        return f"{uri.rstrip('/')}/{page}"
    return f"mlflow ui --backend-store-uri {uri}  then http://127.0.0.1:5000/{page}"
