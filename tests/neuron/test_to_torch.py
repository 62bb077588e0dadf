"""A trn1 run taken to another box: an xser checkpoint of the real NxD 0.17 (XLA:CPU) converted by ``hlat convert``,
continued on the torch backend, exported and scored by lm-eval's ``hf`` model and transformers, in the main
environment.

Every step after the NxD leg runs in the main environment's python (torch 2.13 with transformers and lm-eval, no
torch-xla and no NxD: what a GPU or CPU box has), through the commands a user types, so the converted checkpoint is
shown to need nothing of the Neuron stack.

Tolerances: fp32 on XLA:CPU gives the torch backend's losses to 1e-5 relative (test_real_nxd.py: the XLA graph orders
some sums differently), so the continued run's steps 3-4 agree with a torch run that never left to 1e-5 — while a lost
AdamW state or data position, at this learning rate, moves them by more than 1e-3. transformers gives hlat's logits to
~1e-6 in float32 (test_hf.py) and lm-eval's ``hf`` model hlat's per-text log-likelihoods to 1e-5 (test_hf_lm_eval.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.neuron.lane import KEYS, ROOT, train

MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
COMMON = (
    "train.checkpoint_every=2",
    "optimizer.lr=3e-3",
    "optimizer.decay_steps=3",
    "model.max_seq_len=32",  # = train.seq_len: lm-eval's hf model and hlat's cut long texts into the same windows
)
"""As test_resume.py: every leg one schedule, a learning rate at which a lost optimizer state shows."""


@pytest.fixture(scope="module")
def main_python() -> Path:
    """The main environment's interpreter (``make test`` builds it; CI has it, so there it must exist)."""
    if not MAIN_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{MAIN_PYTHON} is missing: run make install-dev before the NxD lane")
        pytest.skip(f"needs the main environment ({MAIN_PYTHON}: make install-dev)")
    return MAIN_PYTHON


def hlat(python: Path, *args: str) -> str:
    """Run ``python -m hlat.cli ARGS`` (the ``hlat`` command) in the main environment; its stdout+stderr."""
    r = subprocess.run([str(python), "-m", "hlat.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"hlat {' '.join(args)}:\n{r.stdout[-3000:]}{r.stderr[-5000:]}"
    return r.stdout + r.stderr


def test_a_trn1_checkpoint_continues_on_torch_and_scores_the_same_through_hf(
    tmp_path: Path, cache: Path, main_python: Path
) -> None:
    """NxD 2 steps -> hlat convert --to torch -> 2 more steps on torch -> hlat export -> transformers and lm-eval.

    Catches: a conversion that loses the AdamW moments, the step count or the loader position (steps 3-4 move by
    ~1e-3), tensors laid out in NxD's sharded order (the loss jumps), a checkpoint that still needs torch-xla to load,
    and an export whose logits or lm-eval scores are not hlat's.
    """
    trn = tmp_path / "trn"
    trn.mkdir()
    train(trn, "trn", cache, "cluster=xla_cpu", *COMMON, "train.steps=2")
    box = tmp_path / "box"  # the other machine: its own MLflow store and runs, the main environment's python
    box.mkdir()
    out = hlat(main_python, "convert", str(trn / "trn" / "checkpoints"), str(box / "from-trn1"), "--to", "torch")
    assert "step_00000002" in out or "from-trn1" in out, out
    straight = train(box, "straight", cache, *COMMON, "train.steps=4", python=str(main_python))
    continued = train(
        box, "continued", cache, *COMMON, "train.steps=4", f"train.resume={box / 'from-trn1'}", python=str(main_python)
    )
    for key in KEYS:
        assert len(continued[key]) == 2, (key, continued)  # steps 3-4 only: it resumed at step 2
        assert continued[key] == pytest.approx(straight[key][2:], rel=1e-5), (key, continued, straight)
    hlat(main_python, "export", str(box / "continued" / "checkpoints"), "--out", str(box / "hf"))
    r = subprocess.run(
        [str(main_python), "-m", "tests.neuron.hf_check", str(box / "continued"), str(box / "hf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["step"] == 4 and got["max_logit_diff"] < 1e-4, got
    assert got["hlat"].keys() == got["hf"].keys() and got["hlat"], got
    for doc, ours in got["hlat"].items():
        assert got["hf"][doc] == pytest.approx(ours, rel=1e-5), (doc, got)
