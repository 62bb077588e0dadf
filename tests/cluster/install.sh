#!/usr/bin/env bash
# What the cluster lane needs from Debian (make test-cluster runs this first): Slurm with accounting, munge and
# MariaDB. Quick when they are there; about a minute on a fresh machine. Needs root.
set -euo pipefail
needed=(slurmctld slurmd slurmdbd sbatch sacct munged mariadbd mariadb-install-db)
missing=0
for b in "${needed[@]}"; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing=1
done
if [ "$missing" = 0 ]; then
  exit 0
fi
start=$(date +%s)
flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 update -q   # one apt-get at a time (lanes run side by side)
DEBIAN_FRONTEND=noninteractive flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 install -y -q slurm-wlm munge slurmdbd mariadb-server
echo "cluster lane: installed slurm-wlm munge slurmdbd mariadb-server in $(( $(date +%s) - start )) s"
