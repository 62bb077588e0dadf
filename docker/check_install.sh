#!/usr/bin/env bash
# Replay a Dockerfile target's install steps without Docker, in a fresh temporary virtualenv, then run the
# image's ENTRYPOINT (`python train.py`) with train.dry_run=true from the replayed /opt/hlat.
#
#   docker/check_install.sh [TARGET] [--build-arg NAME=VALUE ...]      # TARGET: cpu (default), gpu or trn1
#
# The COPY and RUN steps are read from the Dockerfile itself (docker/stages.py), so what is checked is exactly
# what `docker build --target TARGET` runs, in the same order, one fresh shell per RUN, with the stage's ARG and
# ENV values. Only the base image differs: the venv's interpreter ($PYTHON, default python3) stands in for
# python:3.12-slim. The venv is a clean one (no --system-site-packages, no reuse of .venv): reusing an installed
# torch would skip the very step that matters most (torch from the CPU index, before hlat). The RUN steps say
# --no-cache-dir, so every run downloads again (~200 MB of CPU torch + ~150 MB of dependencies): not part of
# `make test`; run it when the Dockerfile, pyproject.toml or constraints.txt change.
# trn1 cannot really be replayed (no DLC here): the venv first gets CPU torch as a stand-in for the DLC's torch,
# which exercises the trn1 step's own logic (stack pins, hlat resolved around a pinned torch, the unchanged-stack
# and new-`pip check`-conflict guards) but not the DLC's actual package set.
# Offline or firewalled from download.pytorch.org? Point the index elsewhere like a build-arg would:
#   docker/check_install.sh cpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple   # with a local +cpu wheel
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target=cpu
if [[ $# -gt 0 && $1 != --* ]]; then target=$1; shift; fi
python=${PYTHON:-python3}
tmp="$(mktemp -d -t hlat-install-check.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT

start=$SECONDS
echo "== venv ($("$python" -V 2>&1)) in $tmp" >&2
"$python" -m venv "$tmp/venv"
# The image's pip is whatever python:3.12-slim ships; a current pip here avoids resolver differences of old ones.
"$tmp/venv/bin/python" -m pip install -q --upgrade pip

if [[ $target == trn1 ]]; then
    index=https://download.pytorch.org/whl/cpu
    for arg in "$@"; do [[ $arg == TORCH_INDEX_URL=* ]] && index=${arg#TORCH_INDEX_URL=}; done
    echo "== stand-in for the DLC's torch: torch from $index" >&2
    "$tmp/venv/bin/python" -m pip install -q --index-url "$index" -c "$repo/constraints.txt" torch
fi

"$tmp/venv/bin/python" "$repo/docker/stages.py" replay "$target" --root "$tmp/root" "$@" > "$tmp/steps.sh"
echo "== replaying the RUN steps of target '$target'" >&2
# The venv's bin comes first on PATH, so the steps' `python -m pip` is the venv's, as /usr/local/bin's in the image.
# HOME stays, so the user's pip configuration (mirrors, proxies) applies as it would to a `docker build` here.
env -u PYTHONPATH -u VIRTUAL_ENV PATH="$tmp/venv/bin:$PATH" bash "$tmp/steps.sh"
installed=$SECONDS

workdir="$tmp/root/opt/hlat"
entrypoint=()  # one argument per line (no mapfile: macOS ships bash 3.2)
while IFS= read -r word; do
    entrypoint+=("$word")
done < <("$tmp/venv/bin/python" "$repo/docker/stages.py" entrypoint "$target")
echo "== ${entrypoint[*]} train.dry_run=true (in the replayed /opt/hlat)" >&2
# HOME is a fresh one, as the image's user has: nothing cached by earlier runs (data, tokenizers) is reused.
(cd "$workdir" && env -u PYTHONPATH PATH="$tmp/venv/bin:$PATH" HOME="$tmp/home" \
    "${entrypoint[@]}" train.dry_run=true)
# hlat must come from site-packages (as in the image), not from a source tree on sys.path.
(cd "$workdir" && "$tmp/venv/bin/python" -c "import hlat, sys; p = hlat.__file__; print('hlat imported from', p); \
sys.exit(0 if 'site-packages' in p else 'hlat was not imported from site-packages')")
echo "== ok: install $((installed - start)) s, total $((SECONDS - start)) s" >&2
