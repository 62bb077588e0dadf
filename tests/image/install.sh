#!/usr/bin/env bash
# What the image lane needs from Debian (make test-image runs this first): podman (rootful, daemonless), runc (crun
# 1.8 refuses a VM whose cgroups are in hybrid mode) and debootstrap (the local Debian base: no registry is used).
# Quick when they are there; about 20 s on a fresh machine. Needs root; changes nothing in /etc/containers
# (tests/image/containers.conf is named by CONTAINERS_CONF instead).
set -euo pipefail
missing=0
for b in podman runc debootstrap; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing=1
done
if [ "$missing" = 0 ]; then
  exit 0
fi
start=$(date +%s)
# Other lanes' apt-gets run beside this one in .ci/run: flock takes turns (apt's own lock timeout does not cover update).
flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 update -q   # one apt-get at a time (lanes run side by side)
DEBIAN_FRONTEND=noninteractive flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
  podman runc debootstrap
echo "image lane: installed podman runc debootstrap in $(( $(date +%s) - start )) s"
