"""Where hlat's MLflow data lives and how it is shown: the store's URI, check and safe creation, experiments, UI.

mlflow itself is imported only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import socket
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, TrackerConfig
from hlat.track.credentials import PASSWORD, TOKEN, USERNAME, auth_header, without_credentials

log = logging.getLogger(__name__)


def default_uri() -> str:
    """A sqlite store ``mlflow.db`` in the working directory (``mlflow ui`` opens it from there)."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


ENV_URI = "MLFLOW_TRACKING_URI"
"""MLflow's own variable for the store: honoured by every hlat command, below a URI given on its command line."""
CONFIGURED = "tracker.uri in the config"
ON_COMMAND_LINE = "tracker.uri on the command line"
DEFAULT = "the default: mlflow.db in the working directory"


@dataclass(frozen=True)
class Store:
    """The MLflow store a command uses and where that choice came from (:func:`resolve_store`)."""

    uri: str
    source: str

    def line(self, command: str) -> str:
        """What the command says on stderr: ``hlat compare: MLflow store URI (from SOURCE)``, no password in it."""
        return f"{command}: MLflow store {without_credentials(self.uri)} (from {self.source})"


def resolve_store(
    given: str | None = None,
    *,
    configured: str | Callable[[], str | None] | None = None,
    given_as: str = "--uri",
    environ: Mapping[str, str] | None = None,
) -> Store:
    """The MLflow store of every hlat command that uses one.

    In this order of precedence:

    1. ``given``: what this command was told (``--uri``, or ``tracker.uri=`` among its overrides), named ``given_as``;
    2. ``MLFLOW_TRACKING_URI`` (MLflow's own variable, e.g. a team server set once in a shell profile);
    3. ``configured``: ``tracker.uri`` of the composed config (``conf/``), or a function that composes it, called
       only when 1 and 2 are unset (``hlat compare`` composes ``conf/`` only then);
    4. ``mlflow.db`` in the working directory, by absolute path.
    """
    env = os.environ if environ is None else environ
    if given:
        return Store(given, given_as)
    if env.get(ENV_URI):
        return Store(env[ENV_URI], ENV_URI)
    value = configured() if callable(configured) else configured
    return Store(value, CONFIGURED) if value else Store(default_uri(), DEFAULT)


def uri_on_command_line(overrides: Sequence[str]) -> bool:
    """Whether the Hydra ``overrides`` set ``tracker.uri`` (``tracker.uri=``, ``+tracker.uri=``, ``++tracker.uri=``)."""
    return any(o.lstrip("+").partition("=")[0].strip() == "tracker.uri" for o in overrides)


def command_store(uri: str | None, overrides: Sequence[str]) -> Store:
    """The store of a Hydra command whose composed ``tracker.uri`` is ``uri`` (:func:`resolve_store`).

    ``tracker.uri`` among the ``overrides`` is the command's own, like ``--uri``: it beats ``MLFLOW_TRACKING_URI``;
    one from the config files does not.
    """
    on_line = uri_on_command_line(overrides)
    return resolve_store(uri if on_line else None, configured=None if on_line else uri, given_as=ON_COMMAND_LINE)


def command_tracker(tracker: TrackerConfig, overrides: Sequence[str]) -> tuple[TrackerConfig, Store]:
    """A Hydra command's tracker config and store (:func:`command_store`).

    A ``tracker.uri`` of the config files that ``MLFLOW_TRACKING_URI`` overrules is cleared, so that
    :func:`run_store_uri` (every part of the run, its processes and evaluations, which inherit the variable) opens
    the same store.
    """
    store = command_store(tracker.uri, overrides)
    if store.source == ENV_URI and tracker.uri is not None:
        tracker = dataclasses.replace(tracker, uri=None)
    return tracker, store


def run_store_uri(uri: str | None) -> str:
    """The store of a run whose ``tracker.uri`` :func:`command_tracker` settled.

    That ``uri``, else ``MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the working directory.
    """
    return resolve_store(uri, given_as="tracker.uri").uri


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
    from urllib.parse import parse_qs, urlsplit

    uri = run_store_uri(cfg.uri)
    key = "tracker.uri" if cfg.uri or not os.environ.get(ENV_URI) else ENV_URI  # where the user fixes it
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+")[0].lower()  # postgresql+psycopg2 -> postgresql
    shown = without_credentials(uri)  # never print a password
    fixes = (
        f"fix {key}, unset it (the local store ./mlflow.db) or use tracker=console"
        if cfg.uri or key == ENV_URI
        else "run from a writable directory, set tracker.uri to a writable store or use tracker=console"
    )
    if scheme in _SERVER_PORTS:
        host, port = parts.hostname or "localhost", parts.port or _SERVER_PORTS[scheme]
        socket_dir = parse_qs(parts.query).get("host", [""])[0] if scheme == "postgresql" else ""
        address = f"{socket_dir}/.s.PGSQL.{port}" if socket_dir.startswith("/") else (host, port)  # libpq's socket
        error = _http_error(uri, timeout_s) if scheme.startswith("http") else _connect_error(address, timeout_s)
        if error is not None:
            start = f"mlflow server --host {host} --port {port}" if scheme.startswith("http") else "the database"
            where = address if isinstance(address, str) else f"{host}:{port}"
            raise ConfigError(
                f"{key}={shown}: nothing answers at {where} within {timeout_s:g} s "
                f"({error}); start the server ({start}), {fixes}"
            )
        refused = _credentials_refused(uri, timeout_s) if scheme.startswith("http") else None
        if refused is not None:
            raise ConfigError(f"{key}={shown}: {refused}")
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
        raise ConfigError(f"{key}={shown}: {problem}; {fixes}")


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


def _credentials_refused(uri: str, timeout_s: float) -> str | None:
    """Why a server that answers refuses this process's credentials (None: it takes them, or cannot tell).

    One read of the tracking API with the ``Authorization`` MLflow's client would send: a 401 means training would
    die at its first request, after everything is built. (``/health`` needs no login, so it cannot tell.)
    """
    import os
    import ssl
    import urllib.error
    import urllib.request

    if os.environ.get("MLFLOW_TRACKING_AUTH"):  # an auth plugin of MLflow's: only MLflow knows what it sends
        return None
    header = auth_header()
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1")
    if header is not None:
        request.add_header("Authorization", header)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as e:
        if e.code != 401:  # 403, 404 (an old server, a proxy's path): the run's own requests will say
            return None
    except (OSError, ValueError, ssl.SSLError):  # gone meanwhile, TLS settings only MLflow has: it will say
        return None
    if header is None:
        return f"the server asks for a login (HTTP 401); set {USERNAME} and {PASSWORD} (or {TOKEN}) in the environment"
    via = f"{USERNAME} and {PASSWORD}" if header.startswith("Basic") else TOKEN
    return f"the server refused the login in {via} (HTTP 401); set the right one (the server's admin sets passwords)"


def _connect_error(address: tuple[str, int] | str, timeout_s: float) -> str | None:
    """Why a connect to TCP ``(host, port)`` or to a Unix socket's path failed (None: it succeeded)."""
    try:
        if isinstance(address, str):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout_s)
                s.connect(address)
                return None
        with socket.create_connection(address, timeout=timeout_s):
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


def open_client(uri: str) -> Any:
    """An ``MlflowClient`` on store ``uri``, whose tables are created and migrated once, whoever opens it first.

    MLflow creates a database store's tables and runs its migrations when the first client of a process opens it,
    unguarded: processes opening a new store at once (a shell loop, a job array, a team) run the migrations together
    and die in them (``duplicate column name``), or find a half-migrated schema. Every opener here takes the
    store's lock around that first open: a ``<db>.lock`` file beside a sqlite store (``flock``), an advisory lock in
    a PostgreSQL or MySQL database. A server (``http://``) migrates its store itself when it starts.
    """
    from mlflow import MlflowClient

    if _scheme(uri) in ("sqlite", "postgresql", "mysql", "mssql"):
        # What opening a database store imports (~4 s on a busy machine), imported before the lock, not under it:
        # the openers queue for the lock only as long as the open itself takes (~0.4 s).
        import alembic.script  # noqa: F401  (MLflow's schema check reads the migrations' head with it)
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    with _store_lock(uri):
        return MlflowClient(tracking_uri=uri)  # builds the store: creates and migrates its tables if need be


_LOCK_NAME = "hlat-mlflow-store-init"
_PG_LOCK_KEY = zlib.crc32(_LOCK_NAME.encode())
"""The PostgreSQL advisory lock id that openers of one database agree on (any fixed number would do)."""


def _scheme(uri: str) -> str:
    """The database or protocol of store ``uri``: ``postgresql+psycopg2://`` -> ``postgresql``."""
    from urllib.parse import urlsplit

    return urlsplit(uri).scheme.split("+")[0].lower()


@contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Hold the lock that serializes the creation of store ``uri`` (nothing to hold for a server or ``file:``)."""
    scheme = _scheme(uri)
    db = uri.removeprefix("sqlite:///").split("?", 1)[0] if scheme == "sqlite" else ""
    if scheme == "sqlite" and db not in ("", ":memory:") and db != uri:  # in memory: one process only
        with _sqlite_lock(Path(db)):
            yield
    elif scheme in ("postgresql", "mysql"):
        with _database_lock(uri, scheme):
            yield
    else:
        yield


@contextmanager
def _sqlite_lock(db: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<db>.lock``, beside the store: every host that mounts it sees it.

    Held while the store is opened, unless the file says that an opener of this MLflow version created and migrated
    this very db: then no schema changes, and the openers of a big job array need not queue.
    """
    path = Path(f"{db}.lock")
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is creating the MLflow store (%s)", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        if lock.read() == _migrated_mark(db):
            fcntl.flock(lock, fcntl.LOCK_UN)
            yield
            return
        yield  # MLflow creates and migrates the store now; closing the file releases the lock, even if this dies
        lock.truncate(0)
        lock.write(_migrated_mark(db))


def _migrated_mark(db: Path) -> str:
    """What ``<db>.lock`` says once ``db`` is migrated.

    MLflow's version (a newer one may migrate again) and the db's inode (a store deleted and made anew is new).
    """
    import mlflow

    return f"migrated by mlflow {mlflow.__version__}: inode {db.stat().st_ino if db.exists() else None}\n"


@contextmanager
def _database_lock(uri: str, scheme: str) -> Iterator[None]:
    """A session-level advisory lock in the database of ``uri``: released by the server if this process dies."""
    import sqlalchemy

    take, give = (
        (f"SELECT pg_advisory_lock({_PG_LOCK_KEY})", f"SELECT pg_advisory_unlock({_PG_LOCK_KEY})")
        if scheme == "postgresql"
        else (f"SELECT GET_LOCK('{_LOCK_NAME}', -1)", f"SELECT RELEASE_LOCK('{_LOCK_NAME}')")
    )
    engine = sqlalchemy.create_engine(uri, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(take))
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text(give))
    finally:
        engine.dispose()


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
