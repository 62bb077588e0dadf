# syntax=docker/dockerfile:1
#
# hlat images. Three targets; build with BuildKit from the repository root:
#   docker build --target trn1 -t hlat:trn1 .   # trn1 hosts: the Neuron SDK 2.28 PyTorch training DLC + hlat
#   docker build --target cpu  -t hlat:cpu  .   # any x86_64/arm64 host: python:3.12-slim + CPU torch + hlat
#   docker build --target gpu  -t hlat:gpu  .   # NVIDIA hosts: python:3.12-slim + PyPI's CUDA torch + hlat
# Every image runs `python train.py` in /opt/hlat; arguments are Hydra overrides:
#   docker run --rm hlat:cpu model=small train.steps=10
# Nothing NEURON_*/XLA_* is set here: hlat derives those from the run config at launch (backends/neuron.py),
# and provenance.json records them per run.
# docker/check_install.sh replays a target's COPY/RUN steps (read from this file) in a fresh venv without Docker;
# tests/unit/test_dockerfile.py lints this file and asserts the facts stated in its comments.

# The exact SDK 2.28 tag (the Neuron SDK 2.28 release notes): torch 2.9.0, torch-neuronx 2.9.0.2.12.22436,
# neuronx-cc 2.23.6484.0, neuronx_distributed 0.17.26814, NxDT 1.7.0, Python 3.12, Ubuntu 24.04. 2.28 is the last
# SDK that supports NxD Core training; later tags are accepted as a build-arg but are not what hlat targets.
ARG NEURON_DLC_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx
ARG NEURON_DLC_TAG=2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04
ARG PYTHON_VERSION=3.12
# The cpu/gpu base: any image whose `python` is its own interpreter with pip (tests/image builds one from Debian).
ARG PYTHON_BASE_IMAGE=python:${PYTHON_VERSION}-slim

# ---------------------------------------------------------------------------------------------------------------
# trn1: the DLC already holds torch 2.9 (+ torch-xla), torch-neuronx, neuronx-cc, neuronx_distributed and NxDT,
# installed from the Neuron pip repository. Never pip-install torch-neuronx / neuronx-distributed here: on PyPI
# those names are empty placeholders, and any reinstall of torch would break the torch/torch-xla ABI match.
FROM ${NEURON_DLC_IMAGE}:${NEURON_DLC_TAG} AS trn1

# Regex (ERE, case-insensitive) over `pip list --format=freeze` naming the DLC packages hlat must not change:
# the torch family, everything Neuron (torch-neuronx, neuronx-cc, neuronx_distributed(_training), libneuronxla,
# aws-neuronx-*), nki, the CUDA/triton wheels PyPI's torch brings along, and numpy (the ABI the compiled
# extensions were built against; pinning it makes pip pick e.g. a pandas that fits it instead of upgrading it).
ARG DLC_STACK="^(torch[a-z0-9._-]*|[a-z0-9._-]*neuron[a-z0-9._-]*|nki[a-z0-9._-]*|triton|nvidia-[a-z0-9._-]*|numpy)=="
# strict: fail the build when installing hlat adds a `pip check` conflict the DLC did not already have;
# warn: only print it (for a DLC whose declared pins are known to be over-tight).
ARG DLC_PIP_CHECK=strict

# The DLC's Dockerfile sets `HEALTHCHECK curl localhost:8080/ping` for SageMaker serving; a trainer has no such
# endpoint, so the inherited check would only mark every training container unhealthy.
HEALTHCHECK NONE
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/hlat
COPY pyproject.toml README.md train.py ./
COPY src/ src/
COPY conf/ conf/
COPY sweeps/ sweeps/

# How hlat is installed without replacing the DLC's torch: a constraints file generated from the DLC itself
# pins every DLC_STACK package to the exact version installed, then hlat and its dependencies are installed
# normally. Chosen over `--no-deps` + a hand-written dependency list because pyproject.toml stays the one list
# of dependencies (no second copy to drift), and pip's resolver still checks hlat's ranges (torch>=2.6 admits
# 2.9; requires-python>=3.10 admits 3.12): a conflict with the pins fails this build instead of silently
# swapping torch. Packages outside the stack stay as the DLC has them whenever they satisfy hlat's ranges
# (pip's default only-if-needed strategy); constraints.txt (CI's CPU versions, torch 2.13) is not used here.
# The last lines prove the contract: every stack package is still there at the same version (new ones, e.g. a
# numpy the DLC lacked, may appear) and no new `pip check` conflict appeared.
RUN set -e; \
    python -m pip list --format=freeze | { grep -iE "${DLC_STACK}" || true; } > /tmp/dlc-stack.txt; \
    grep -iq '^torch==' /tmp/dlc-stack.txt || { echo "no torch in the base image: not a PyTorch DLC" >&2; exit 1; }; \
    python -m pip check > /tmp/pip-check-before.txt || true; \
    python -m pip install --no-cache-dir -c /tmp/dlc-stack.txt .; \
    python -m pip list --format=freeze | { grep -iE "${DLC_STACK}" || true; } > /tmp/dlc-stack-after.txt; \
    changed=$(comm -23 <(sort /tmp/dlc-stack.txt) <(sort /tmp/dlc-stack-after.txt)); \
    if [ -n "$changed" ]; then printf 'installing hlat changed the DLC stack:\n%s\n' "$changed" >&2; exit 1; fi; \
    python -m pip check > /tmp/pip-check-after.txt || true; \
    new=$(comm -13 <(sort /tmp/pip-check-before.txt) <(sort /tmp/pip-check-after.txt)); \
    if [ -n "$new" ]; then \
        printf 'installing hlat added dependency conflicts to the DLC:\n%s\n' "$new" >&2; \
        [ "${DLC_PIP_CHECK}" = warn ]; \
    fi; \
    python -c "import hlat.cli, torch; print('hlat on torch', torch.__version__)"; \
    rm -f /tmp/dlc-stack*.txt /tmp/pip-check-*.txt

# Runs as root, like the DLC it extends: the DLC is built for root (Python and pip config under /usr/local and
# /root, NxDT files in /root, SSH keys for MPIJob launches, the compile cache in /var/tmp), and Neuron devices
# (/dev/neuron*) and EFA (/dev/infiniband/uverbs*, unlimited locked memory) need root or host-matched ids.
# On trn1: docker run --device=/dev/neuron0 ... (all 16 on trn1.32xlarge) --ulimit memlock=-1 --shm-size=...
# The DLC's own ENTRYPOINT (start_with_right_hostname.sh, a SageMaker hostname fix) is replaced on purpose.
ENTRYPOINT ["python", "train.py"]

# ---------------------------------------------------------------------------------------------------------------
# CPU/GPU hosts: the official slim Python image, a non-root user, hlat installed into the system interpreter.
FROM ${PYTHON_BASE_IMAGE} AS python-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# /opt/hlat belongs to the user so a run can create outputs/, multirun/ and mlflow.db in it (all relative to the
# working directory); the code copied into it stays root-owned. Mount a volume on /opt/hlat/outputs to keep runs.
RUN useradd --create-home --uid 1000 --shell /bin/bash hlat \
 && install -d -o hlat -g hlat /opt/hlat
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/hlat

# The cpu and gpu stages run the same steps (test_dockerfile.py keeps them identical); only the torch index
# differs. torch is installed FIRST and pinned by constraints.txt: a bare torch requirement pulls multi-GB CUDA
# wheels from PyPI, and hlat's own install then finds torch already satisfied.
FROM python-base AS cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY constraints.txt ./
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" -c constraints.txt torch
COPY pyproject.toml README.md train.py ./
COPY src/ src/
COPY conf/ conf/
COPY sweeps/ sweeps/
RUN python -m pip install --no-cache-dir -c constraints.txt . \
 && python -m pip check \
 && python -c "import hlat.cli, torch; print('hlat on torch', torch.__version__)"
# The user hlat, by number: Kubernetes' runAsNonRoot can only verify a numeric USER.
USER 1000:1000
ENTRYPOINT ["python", "train.py"]

# PyPI's Linux torch wheel is the CUDA build (its CUDA libraries come as nvidia-* wheels), so the GPU image only
# needs the host's NVIDIA driver: docker run --gpus all hlat:gpu cluster=gpu. For another CUDA version, point
# TORCH_INDEX_URL at a PyTorch CUDA index holding constraints.txt's torch (https://download.pytorch.org/whl/cuXYZ).
FROM python-base AS gpu
ARG TORCH_INDEX_URL=https://pypi.org/simple
COPY constraints.txt ./
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" -c constraints.txt torch
COPY pyproject.toml README.md train.py ./
COPY src/ src/
COPY conf/ conf/
COPY sweeps/ sweeps/
RUN python -m pip install --no-cache-dir -c constraints.txt . \
 && python -m pip check \
 && python -c "import hlat.cli, torch; print('hlat on torch', torch.__version__)"
# The user hlat, by number: Kubernetes' runAsNonRoot can only verify a numeric USER.
USER 1000:1000
ENTRYPOINT ["python", "train.py"]
