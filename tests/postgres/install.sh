#!/usr/bin/env bash
# What the PostgreSQL lane needs from Debian (make test-postgres runs this first): PostgreSQL (15 on Debian 12),
# whose initdb and pg_ctl scripts/mlflow-server.sh runs. Quick when it is there; about 30 s on a fresh machine.
# Needs root.
set -euo pipefail
for initdb in /usr/lib/postgresql/*/bin/initdb; do
  if [ -x "$initdb" ]; then
    exit 0
  fi
done
start=$(date +%s)
flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 update -q   # one apt-get at a time (lanes run side by side)
# The package's own cluster (main, port 5432) does not matter: the lane runs its own, without TCP, in a temp directory
DEBIAN_FRONTEND=noninteractive flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 install -y -q postgresql
echo "postgres lane: installed postgresql in $(( $(date +%s) - start )) s"
