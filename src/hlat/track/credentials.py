"""A tracking store's credentials: handed to MLflow (and PostgreSQL) through the environment, never recorded.

A tracking URI may carry a user name and password (``http://alice:pw@mlflow.internal:5000``). hlat takes them off
once, as early as it sees the URI: the command line (``tracker.uri=...``, ``--uri``) before Hydra records it, the
composed config before Hydra writes ``.hydra/``, ``MLFLOW_TRACKING_URI``. They go into the variables the clients
read for this process and its children: ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (MLflow's
basic auth) for ``http(s)://``, ``PGPASSWORD`` (libpq) for ``postgresql://``. Everything written afterwards (Hydra's
``.hydra/``, the run's config, MLflow params and tags, spools, logs) holds :func:`without_credentials` of the URI.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from urllib.parse import unquote

from hlat.config import ConfigError
from hlat.config.ops import USERINFO, holds_credentials, secret_userinfo

USERNAME = "MLFLOW_TRACKING_USERNAME"
PASSWORD = "MLFLOW_TRACKING_PASSWORD"
TOKEN = "MLFLOW_TRACKING_TOKEN"
"""The variables MLflow's clients read for a tracking server's basic auth (user and password) or bearer token."""
PG_PASSWORD = "PGPASSWORD"
"""libpq's password variable, which psycopg (SQLAlchemy's PostgreSQL driver) reads when the URI has none."""
KEYS = ("tracker.uri", "--uri")
"""The command-line arguments that name a tracking store: Hydra's override and the flag of ``hlat compare`` /
``hlat track sync``."""
_FIX = f"set {USERNAME} and {PASSWORD} (or {TOKEN}) in the environment instead"


def without_credentials(uri: str) -> str:
    """``uri`` without the secrets of any URL in it: what may be shown or written down.

    The secret user information (:func:`has_credentials`) goes, and so does the value of a ``password=`` query
    parameter (libpq's): ``postgresql://db/x?password=p`` -> ``postgresql://db/x?password=***``. String edits only:
    rebuilding the URL would turn ``sqlite:////abs/path`` into ``sqlite://abs/path``.
    """
    uri = USERINFO.sub(lambda m: _kept(m[1], m[2]), uri)
    return _QUERY_PASSWORD.sub(r"\1***", uri)


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s]*", re.IGNORECASE)


def _kept(scheme: str, userinfo: str) -> str:
    """What stays of ``scheme://userinfo@``: all of it unless secret; else a PostgreSQL role, nothing of http's."""
    if not secret_userinfo(scheme, userinfo):
        return f"{scheme}://{userinfo}@"
    if scheme.lower() in ("http", "https"):
        return f"{scheme}://"
    return f"{scheme}://{userinfo.partition(':')[0]}@"


has_credentials = holds_credentials
"""Whether a URI holds a secret: any user information of ``http(s)``, a password of other schemes."""


def adopt(uri: str, key: str = "tracker.uri", env: MutableMapping[str, str] | None = None) -> str:
    """Move the user name and password of tracking URI ``uri`` into the environment; the URI without them.

    ``http(s)``: :data:`USERNAME` and :data:`PASSWORD`; ``postgresql``: the password into :data:`PG_PASSWORD` (the
    user name stays in the URI). ``key`` names the setting in errors; ``env``: default ``os.environ``.

    Raises:
        ConfigError: A user name without a password, a scheme whose driver reads no password variable, or a
            password that differs from one already in the environment.
    """
    env = os.environ if env is None else env
    return USERINFO.sub(lambda m: _take(m[1], m[2], key, uri, env), uri)


def _take(scheme: str, userinfo: str, key: str, uri: str, env: MutableMapping[str, str]) -> str:
    """Put one URL's ``userinfo`` where the client of ``scheme`` reads it; what replaces ``scheme://userinfo@``."""
    if not secret_userinfo(scheme, userinfo):
        return f"{scheme}://{userinfo}@"
    user, colon, password = (unquote(p) for p in userinfo.partition(":"))
    shown = f"{key}={without_credentials(uri)}"
    if not colon or not password:
        raise ConfigError(
            f"{shown}: the URI names a user without a password; give user:password@ in the URI, or {_FIX}"
        )
    base = scheme.split("+")[0].lower()
    if base in ("http", "https"):
        wanted = {USERNAME: user, PASSWORD: password}
    elif base == "postgresql":
        wanted = {PG_PASSWORD: password}  # the role stays in the URI: libpq needs it there
    else:
        raise ConfigError(
            f"{shown}: hlat keeps passwords out of its records but has no way to hand a {base} driver its "
            "password; use an http(s) tracking server (scripts/mlflow-server.sh) or the driver's own password file"
        )
    clash = [k for k, v in wanted.items() if env.get(k) not in (None, v)]
    if clash:
        raise ConfigError(
            f"{shown}: the URI's credentials differ from {' and '.join(clash)} in the environment; give them once, "
            "in the URI or (preferred) in the environment"
        )
    env.update(wanted)
    return _kept(scheme, userinfo)


def adopt_arguments(args: Sequence[str]) -> list[str]:
    """Command-line arguments with the credentials of every tracking store they name moved into the environment.

    Hydra overrides of ``tracker.uri`` (``tracker.uri=``, ``+tracker.uri=``, ``++tracker.uri=``, sweeps of several
    URIs) and ``--uri URI`` / ``--uri=URI``; every other argument unchanged.

    Raises:
        ConfigError: As :func:`adopt`.
    """
    out = list(args)
    for i, arg in enumerate(out):
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+~") in KEYS:
            out[i] = f"{key}={adopt(value, key.lstrip('+~'))}"
        elif i and out[i - 1] == "--uri":
            out[i] = adopt(arg, "--uri")
    return out


def adopt_environment(env: MutableMapping[str, str] | None = None) -> None:
    """``MLFLOW_TRACKING_URI`` without credentials: they move to their variables (:func:`adopt`).

    Raises:
        ConfigError: As :func:`adopt`.
    """
    env = os.environ if env is None else env
    uri = env.get("MLFLOW_TRACKING_URI")
    if uri and has_credentials(uri):
        env["MLFLOW_TRACKING_URI"] = adopt(uri, "MLFLOW_TRACKING_URI", env)


def auth_header(env: Mapping[str, str] | None = None) -> str | None:
    """The ``Authorization`` header MLflow's client sends with these variables (basic first, as it does), or None."""
    env = os.environ if env is None else env
    if env.get(USERNAME) and env.get(PASSWORD):
        pair = f"{env[USERNAME]}:{env[PASSWORD]}".encode()
        return "Basic " + base64.standard_b64encode(pair).decode()
    if env.get(TOKEN):
        return f"Bearer {env[TOKEN]}"
    return None
