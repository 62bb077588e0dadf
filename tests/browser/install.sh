#!/usr/bin/env bash
# Debian's chromium for the MLflow UI test (tests/integration/test_mlflow_ui.py) and scripts/mlflow_ui_screenshot.py:
# Playwright (the dev extra) drives it; `playwright install` is never run, no browser is downloaded. Quick when
# chromium is there; about a minute on a fresh Debian 12 (113 MB of packages). Needs root.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
start=$(date +%s)
flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 update -q   # one apt-get at a time (lanes run side by side)
DEBIAN_FRONTEND=noninteractive flock /var/lock/hlat-apt apt-get -o DPkg::Lock::Timeout=600 install -y -q chromium
echo "browser: installed chromium in $(( $(date +%s) - start )) s"
