# Two commands do all set-up on a fresh machine:
#   make demo   # venv + install + `python train.py` (tiny model, builtin corpus, ./mlflow.db)
#   make test   # venv + install + dev tools + the fast test suite (make test-slow: the slow end-to-end tests)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first and pinned. On Linux, PyPI's torch is the CUDA build (several GB with its nvidia-* wheels):
# without an NVIDIA GPU, scripts/torch_pip_args.py picks PyTorch's CPU index (TORCH_CPU_INDEX) when it answers, and
# says on stderr what it chose. TORCH_PIP_ARGS=... on the command line (or in the environment) replaces that choice;
# TORCH_PIP_ARGS= (empty) installs from pip's own index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(origin TORCH_PIP_ARGS),undefined)
TORCH_PIP_ARGS = $(shell python3 scripts/torch_pip_args.py $(TORCH_CPU_INDEX))
endif

.PHONY: demo test test-slow test-bitwise test-neuron test-cluster test-postgres test-image test-readme lint install install-dev install-eval clean

# Three stamps: `make demo` installs what a run needs (torch + hlat), `make test` adds the dev tools on top, and
# `make install-eval` lm-evaluation-harness (the `eval` extra: `hlat eval`, eval.every_tokens), which the demo skips.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

$(VENV)/.installed-eval: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[eval]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

install-eval: $(VENV)/.installed-eval

demo: install
	$(PY) train.py $(ARGS)
	@echo "next: source $(VENV)/bin/activate   # once per shell: python, hlat and mlflow in the README are the project's"

# `make test` is the fast suite (-m "not slow"); `make test-slow` runs the end-to-end variants marked slow (multi-process
# training, recovery, preemption, sweeps, the MLflow UI); CI (.ci/run) runs both. A wall-clock limit in a test is only a
# hang guard (tests/timeouts.py): HLAT_TEST_TIMEOUT_FACTOR=3 make test triples every one of them for a slower machine;
# no test asserts on speed. The suites and the README lane run on WORKERS pytest-xdist workers (one pytest process
# keeps one core busy, and many tests wait on processes they start); each doc's README lane commands, and the tests of
# a module with a costly shared fixture, are one unit of work (xdist_group in tests/conftest.py). WORKERS=0: no xdist.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadgroup

test: install-dev
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(ARGS)

test-slow: install-dev
	$(PY) -m pytest -q -m slow $(XDIST) $(ARGS)

# The bitwise tests again on the other kernels: those marked `bitwise` (pytest -m bitwise) assert that two
# computations running different kernels, shards or reduction layouts agree bit for bit, which the kernels' arithmetic
# could make hold on one CPU and not another (vector width, BLAS path). make test and make test-slow run them on this
# host's kernels; this runs them on the AVX2 kernels of ATen and MKL, what an AVX2-only machine runs. On a host whose
# kernels are AVX2 already it says so and stops: that run was the one above.
test-bitwise: install-dev
	@cap="$$($(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"; \
	if [ "$$cap" = AVX2 ] || [ "$$cap" = DEFAULT ]; then \
	    echo "test-bitwise: this host's kernels are $$cap already; make test and make test-slow ran the bitwise tests on them"; \
	    exit 0; fi; \
	export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2; \
	got="$$($(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"; \
	if [ "$$got" != AVX2 ]; then echo "test-bitwise: ATEN_CPU_CAPABILITY=avx2 gave $$got kernels, not AVX2" >&2; exit 1; fi; \
	echo "test-bitwise: the bitwise tests again on the AVX2 kernels (this host's own are $$cap)"; \
	$(PY) -m pytest -q -m bitwise $(XDIST) $(ARGS)

# The NxD lane: the neuron backend against the real NeuronX Distributed 0.17 on torch-xla's CPU device, in its own
# environment (.venv-neuron: torch 2.9 + torch-xla 2.9 from PyPI, ~4 GB, ~5 min the first time; reused after), NxD
# from the Neuron pip repository or from NXD_SOURCE=<a local copy> (tests/neuron/setup_venv.sh).
test-neuron:
	bash tests/neuron/setup_venv.sh
	.venv-neuron/bin/python -m pytest -q tests/neuron $(ARGS)

# The cluster lane (root; Linux network namespaces): a real two-node Slurm cluster with accounting, started and torn
# down by the tests (tests/cluster/slurm.py); tests/cluster/install.sh apt-gets slurm-wlm munge slurmdbd mariadb-server
# where missing.
test-cluster: install-dev
	bash tests/cluster/install.sh
	HLAT_CLUSTER_LANE=1 $(PY) -m pytest -q -m cluster tests/cluster $(ARGS)

# The PostgreSQL lane (root): the team tracking server (scripts/mlflow-server.sh) on a real PostgreSQL in a temporary
# directory: runs started together on it, and the server killed under training (outages); tests/postgres/install.sh
# apt-gets postgresql where missing, the `team` extra brings its Python driver (psycopg).
$(VENV)/.installed-team: $(VENV)/.installed-dev
	$(PY) -m pip install -q -c constraints.txt -e ".[team]"
	touch $@

test-postgres: $(VENV)/.installed-team
	bash tests/postgres/install.sh
	HLAT_POSTGRES_LANE=1 $(PY) -m pytest -q tests/postgres $(ARGS)

# The image lane (root): the Dockerfile's cpu and trn1 targets built with podman from local bases (debootstrap, no
# registry; tests/image/build.sh: ~11 min and 3.8 GB the first time, seconds after), then trained in (~4 min),
# stopped, resumed and checked from inside (tests/image/). tests/image/install.sh apt-gets podman runc debootstrap.
test-image: install-dev
	bash tests/image/install.sh
	HLAT_IMAGE_LANE=1 HLAT_IMAGE_HOST_PYTHON=$(PY) $(PY) -m pytest -q -p no:cacheprovider tests/image $(ARGS)

# The README lane: every command of README.md and docs/*.md, run as written in a fresh shell after `make demo` (tiny
# overrides where a command trains; tests/readme/commands.py lists the few that cannot run here and why).
test-readme: install-dev
	HLAT_README_LANE=1 $(PY) -m pytest -q -p no:cacheprovider tests/readme $(XDIST) $(ARGS)

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .venv-neuron outputs multirun mlruns mlflow.db mlflow.db.lock
