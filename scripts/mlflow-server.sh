#!/usr/bin/env bash
# A team MLflow tracking server for hlat runs: PostgreSQL backend + an artifact directory, proxied artifacts.
#
#   scripts/mlflow-server.sh                                # 127.0.0.1:5000, everything in ./mlflow-server/
#   ADMIN_PASSWORD_FILE=~/.mlflow-admin ARTIFACTS=/fsx/mlflow-artifacts HOST=0.0.0.0 \
#     ALLOWED_HOSTS=mlflow.internal:5000 scripts/mlflow-server.sh                     # a team's, behind a login
#   MLFLOW_DB_URI=postgresql://mlflow@db.internal/mlflow scripts/mlflow-server.sh     # a database you already run
#
# Then train with `python train.py tracker.uri=http://<host>:5000`. Without MLFLOW_DB_URI it runs its own
# PostgreSQL (Debian's `postgresql` package; initdb on the first start) in $MLFLOW_STORE/postgres: no TCP port, only
# a Unix socket in that directory, and stops it when the server stops (Ctrl-C). Artifacts (checkpoint records,
# plots, configs) go to ARTIFACTS (default $MLFLOW_STORE/artifacts; a shared filesystem path for a team), served
# through the server, so clients need no access to it. Bound to loopback unless HOST says otherwise; with
# HOST=0.0.0.0, MLflow 3's host-header check needs ALLOWED_HOSTS (the name clients use). One worker and no job
# execution: starts in ~6 s and uses ~520 MB instead of ~20 s and ~3 GB (MLflow 3.17, measured on a 2-core machine).
#
# Who gets in: bound beyond loopback, the server runs MLflow's basic-auth app and answers only its users (clients set
# MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD). Its admin user is made on the first start, with the
# password in the file ADMIN_PASSWORD_FILE or in MLFLOW_AUTH_ADMIN_PASSWORD (at least 12 characters; never on a
# command line, which `ps` shows to every user); users and permissions live in $MLFLOW_STORE/basic_auth.db, and
# every user may read and write every experiment (DEFAULT_PERMISSION=EDIT; deleting one is its creator's or the
# admin's). An admin password turns the login on at loopback too; once on, it stays on. ALLOW_UNAUTHENTICATED=1
# serves beyond loopback without a login, to anyone who reaches it.
# Needs psycopg (3) and Flask-WTF beside mlflow: pip install -c constraints.txt -e ".[team]".
set -euo pipefail
STORE="$(realpath -m "${MLFLOW_STORE:-$PWD/mlflow-server}")"
ARTIFACTS="${ARTIFACTS:-$STORE/artifacts}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-5000}"
DB_URI="${MLFLOW_DB_URI:-}"

case "$HOST" in
  127.*|localhost|::1|"[::1]") loopback=1 ;;
  *) loopback=0 ;;
esac
if [[ -n "${ADMIN_PASSWORD_FILE:-}" ]]; then
  if [[ ! -r "$ADMIN_PASSWORD_FILE" ]]; then
    echo "mlflow-server.sh: ADMIN_PASSWORD_FILE=$ADMIN_PASSWORD_FILE cannot be read; point it at the file that" \
         "holds the admin password (one line)" >&2
    exit 2
  fi
  MLFLOW_AUTH_ADMIN_PASSWORD="$(<"$ADMIN_PASSWORD_FILE")"
  export MLFLOW_AUTH_ADMIN_PASSWORD
fi
auth=0
if [[ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" || -n "${MLFLOW_AUTH_CONFIG_PATH:-}" || -f "$STORE/basic_auth.db" ]]; then
  auth=1  # asked for, or on before: a server that has users never opens up by itself
elif (( ! loopback )) && [[ "${ALLOW_UNAUTHENTICATED:-}" != 1 ]]; then
  echo "mlflow-server.sh: HOST=$HOST would serve every run to anyone who reaches it, with write and delete rights;" \
       "give an admin password (ADMIN_PASSWORD_FILE=<file> or MLFLOW_AUTH_ADMIN_PASSWORD) to turn on MLflow's" \
       "basic auth, or set ALLOW_UNAUTHENTICATED=1 to serve it open" >&2
  exit 2
fi
mkdir -p "$STORE" "$ARTIFACTS"

python="$(dirname "$(command -v mlflow)")/python"
[[ -x "$python" ]] || python=python3
if [[ "$DB_URI" == postgresql* || -z "$DB_URI" ]] && ! "$python" -c "import psycopg" 2>/dev/null; then
  echo "mlflow-server.sh: $python cannot import psycopg (SQLAlchemy 2.1's PostgreSQL driver); install it with" \
       "pip install -c constraints.txt -e \".[team]\"" >&2
  exit 2
fi

if [[ -z "$DB_URI" ]]; then
  if [[ -z "${PG_BIN:-}" ]]; then
    for bin in /usr/lib/postgresql/*/bin; do PG_BIN="$bin"; done  # the newest (versions 10 on sort as text)
  fi
  if [[ ! -x "$PG_BIN/initdb" ]]; then
    echo "mlflow-server.sh: no PostgreSQL (initdb) in /usr/lib/postgresql/*/bin; install Debian's package" \
         "(apt-get install postgresql), set PG_BIN, or give a database as MLFLOW_DB_URI" >&2
    exit 2
  fi
  PGDATA="$STORE/postgres"
  as_owner=()  # PostgreSQL refuses to run as root: root runs it as the postgres user (Debian's package makes it)
  if [[ "$(id -u)" == 0 ]]; then
    as_owner=(runuser -u postgres --)
    mkdir -p "$PGDATA" && chown postgres: "$PGDATA" && chmod 700 "$PGDATA"
    if ! runuser -u postgres -- test -w "$PGDATA"; then
      echo "mlflow-server.sh: the postgres user cannot reach $PGDATA; choose an MLFLOW_STORE whose parent" \
           "directories it may enter (chmod o+x), or give a database as MLFLOW_DB_URI" >&2
      exit 2
    fi
  fi
  if [[ ! -f "$PGDATA/PG_VERSION" ]]; then
    # trust is safe here: no TCP listener, and only the cluster's owner (and root) can enter the socket directory
    "${as_owner[@]}" "$PG_BIN/initdb" -D "$PGDATA" -U mlflow --auth=trust -E UTF8 >"$STORE/initdb.log"
  fi
  if ! "${as_owner[@]}" "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$PGDATA/server.log" -w \
      -o "-c listen_addresses='' -k '$PGDATA'" start >/dev/null; then
    tail -n 20 "$PGDATA/server.log" >&2  # e.g. a socket path over 107 characters: a shorter MLFLOW_STORE
    exit 1
  fi
  trap '"${as_owner[@]}" "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null 2>&1 || true' EXIT
  if ! "$PG_BIN/psql" -h "$PGDATA" -U mlflow -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='mlflow'" \
      | grep -q 1; then
    "$PG_BIN/createdb" -h "$PGDATA" -U mlflow mlflow
  fi
  DB_URI="postgresql://mlflow@/mlflow?host=$PGDATA"
fi

# The database by the environment, not the command line: its URI may hold a password, and `ps` shows arguments
export MLFLOW_BACKEND_STORE_URI="$DB_URI"
args=(--artifacts-destination "$ARTIFACTS" --serve-artifacts --host "$HOST" --port "$PORT" --workers "${WORKERS:-1}")
if [[ -n "${ALLOWED_HOSTS:-}" ]]; then
  args+=(--allowed-hosts "$ALLOWED_HOSTS")
fi
if (( auth )); then
  args+=(--app-name basic-auth)
  if [[ -z "${MLFLOW_AUTH_CONFIG_PATH:-}" ]]; then  # the auth database beside the store; the file holds no secret
    export MLFLOW_AUTH_CONFIG_PATH="$STORE/basic_auth.ini"
    # A login costs MLflow a password hash (~0.5 s of CPU, scrypt): without its cache of logins that succeeded, a
    # busy server spends its time hashing and runs' requests time out. With several WORKERS, a password changed or a
    # user removed through one worker takes up to the cache's 60 s to reach the others.
    printf '%s\n' "[mlflow]" "default_permission = ${DEFAULT_PERMISSION:-EDIT}" \
      "database_uri = sqlite:///$STORE/basic_auth.db" "admin_username = admin" \
      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth" \
      "auth_cache_ttl_seconds = 60" >"$MLFLOW_AUTH_CONFIG_PATH"
  fi
  if [[ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]]; then  # signs the UI's CSRF tokens: kept across restarts
    key="$STORE/flask-secret-key"
    [[ -s "$key" ]] || (umask 077 && head -c 32 /dev/urandom | base64 >"$key")
    MLFLOW_FLASK_SERVER_SECRET_KEY="$(<"$key")"
    export MLFLOW_FLASK_SERVER_SECRET_KEY
  fi
fi
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
# The server migrates a new database at its start, before it answers; then PostgreSQL stops with it.
mlflow server "${args[@]}" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' INT TERM
status=0
wait "$server" || status=$?
if kill -0 "$server" 2>/dev/null; then  # a signal ended the wait, not the server: let it finish
  wait "$server" || status=$?
fi
exit "$status"
