"""The neuron backend through the real NxD 0.17 on XLA:CPU, with the torch backend as the oracle.

Every scenario runs ``python train.py`` in a subprocess (the Neuron variables must be set before torch_xla is
imported, once per process) and reads the run's metrics back from its MLflow store.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.neuron.lane import train


def test_nxd_imports_and_hlat_binds_its_entry_points() -> None:
    """The stub gets the real NxD imported; every entry point the backend uses is NxD's own."""
    code = (
        "import os; os.environ['PJRT_DEVICE'] = 'CPU'\n"
        "from hlat.backends.neuron import _import_api\n"
        "api = _import_api()\n"
        "import inspect\n"
        "for f in (api.nxd.neuronx_distributed_config, api.nxd.initialize_parallel_model,\n"
        "          api.nxd.initialize_parallel_optimizer, api.nxd.save_checkpoint, api.nxd.load_checkpoint,\n"
        "          api.layers.column, api.layers.row, api.layers.qkv, api.layers.embedding,\n"
        "          api.layers.cross_entropy, api.manual_seed):\n"
        "    assert inspect.getsourcefile(f).count('neuronx_distributed'), f\n"
        "print('xla device', api.xm.xla_device())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "xla device xla:0" in r.stdout


MIX_KEYS = ("train/loss/docstrings", "train/loss/topics", "data/mix/topics/share")
KEYS = ("train/loss", "train/grad_norm", *MIX_KEYS)


@pytest.fixture(scope="module")
def xla_fp32(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[Path, dict[str, list[float]]]:
    """``python train.py cluster=xla_cpu data=mix_demo``, fp32, world 1, checkpointing steps 2 and 3: run once for
    this module."""
    tmp = tmp_path_factory.mktemp("xla")
    keys = (*KEYS, "xla/graphs_compiled")
    return tmp, train(tmp, "xla", cache, "cluster=xla_cpu", "data=mix_demo", "train.checkpoint_every=2", keys=keys)


def test_train_py_on_xla_cpu_trains_through_the_real_nxd(xla_fp32: tuple[Path, dict[str, list[float]]]) -> None:
    """``python train.py cluster=xla_cpu``: the neuron backend's whole path (NxD config, parallel model and
    optimizer, step closures, xser checkpoint) on the real library, world 1, fp32: every step logged and finite."""
    tmp, nxd = xla_fp32
    for key in ("train/loss", "train/grad_norm"):
        assert len(nxd[key]) == 3 and all(math.isfinite(v) and v > 0 for v in nxd[key]), (key, nxd[key])
    assert nxd["train/loss"][0] == pytest.approx(math.log(512), rel=0.05)  # ~ln(vocab) at init
    saved = sorted(p.name for p in (tmp / "xla" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000002", "step_00000003"]


def test_fp32_on_xla_cpu_equals_the_torch_backend(
    tmp_path: Path, cache: Path, xla_fp32: tuple[Path, dict[str, list[float]]]
) -> None:
    """``python train.py cluster=xla_cpu`` (world 1, fp32) against ``cluster=cpu``: same weights, data and math.

    Both run fp32 on the same CPU; the XLA graph fuses and orders some sums differently, so the losses and pre-clip
    grad norms of 3 steps should agree to 1e-5 relative, not bitwise. (The XLA run also checkpoints steps 2 and 3:
    a save changes no number, which the resume tests show bitwise.) The data is a mixture (``data=mix_demo``: its
    stage starts at step 3), so each source's loss, tallied in the graph NxD runs, is compared too, and the stage
    change compiles no graph.
    """
    ref = train(tmp_path, "torch", cache, "data=mix_demo", keys=KEYS)
    _, nxd = xla_fp32
    for key in KEYS:
        assert len(nxd[key]) == len(ref[key]) == 3, key
        assert nxd[key] == pytest.approx(ref[key], rel=1e-5), key
    assert nxd["data/mix/topics/share"][2] > nxd["data/mix/topics/share"][1]  # the stage began at step 3
    graphs = nxd["xla/graphs_compiled"]
    assert graphs[2] == graphs[1], graphs  # ... in the graphs step 2 compiled
