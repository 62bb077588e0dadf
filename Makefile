# Two commands do all set-up on a fresh machine:
#   make demo   # venv + install + `python train.py` (tiny model, builtin corpus, ./mlflow.db)
#   make test   # venv + install + dev tools + the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first and pinned: a bare torch requirement pulls multi-GB CUDA wheels on Linux. Elsewhere,
# a CPU-only box can add: make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

.PHONY: demo test test-neuron test-cluster lint install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) train.py $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

# The NxD lane: the neuron backend against the real NeuronX Distributed 0.17 on torch-xla's CPU device, in its own
# environment (.venv-neuron: torch 2.9 + torch-xla 2.9 from PyPI, ~4 GB, ~5 min the first time; reused after).
test-neuron:
	bash tests/neuron/setup_venv.sh
	.venv-neuron/bin/python -m pytest -q tests/neuron $(ARGS)

# The cluster lane (root; Linux network namespaces): a real two-node Slurm cluster with accounting, started and torn
# down by the tests (tests/cluster/slurm.py); tests/cluster/install.sh apt-gets slurm-wlm munge slurmdbd mariadb-server
# where missing.
test-cluster: install
	bash tests/cluster/install.sh
	HLAT_CLUSTER_LANE=1 $(PY) -m pytest -q -m cluster tests/cluster $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .venv-neuron outputs multirun mlruns mlflow.db
