"""Resuming from an xser checkpoint through the real NxD 0.17 on XLA:CPU (world size 1).

A run stopped after step 2 and started again in the same run directory (``train.resume=auto``, the default, takes the
newest valid checkpoint of ``<run dir>/checkpoints``) must continue exactly as a run that was never stopped: same
weights, AdamW state (and fp32 masters), data position and learning rate, so steps 3-4 agree to the bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.neuron.lane import KEYS, train

COMMON = ("cluster=xla_cpu", "train.checkpoint_every=2", "optimizer.lr=3e-3", "optimizer.decay_steps=3")
"""Both runs checkpoint at step 2. The cosine decay spans ``train.steps - warmup`` by default, so the 2-step leg would
decay faster than the 4-step run: ``decay_steps=3`` (the 4-step run's own value) gives every leg one schedule. The
learning rate is 10x the micro default, so that a lost optimizer state changes the update visibly."""


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param((), id="fp32"),
        pytest.param(("precision=master_weights", "parallelism.zero1=true"), id="master_weights_zero1"),
    ],
)
def test_a_run_resumed_from_its_step_2_xser_checkpoint_continues_bitwise(
    tmp_path: Path, cache: Path, mode: tuple[str, ...]
) -> None:
    """``train.steps=4`` straight through, against ``train.steps=2`` then ``train.steps=4`` in the same run directory.

    Losses and pre-clip grad norms of steps 3-4 must be bitwise equal (steps 1-2 too: both legs start from the same
    config and schedule). The resumed leg continues the first leg's MLflow run, so its history holds steps 1-2 from
    the first process and 3-4 from the second. In fp32 the state is NxD's plain optimizer; with master weights it is
    ``NeuronZero1Optimizer``'s sharded state, whose fp32 masters hlat asks NxD to checkpoint
    (``use_master_weights_in_ckpt``).

    Catches: a resume that does not happen or starts over (a second MLflow run, or 6 logged steps), weights, AdamW
    moments or step counts not restored, fp32 masters re-widened from the rounded bf16 weights instead of restored
    (visible at step 4: step 3 runs on the same bf16 weights either way),
    the data loader restarting or skipping batches, a learning rate schedule that restarts, RNG state not restored.
    """
    straight = train(tmp_path, "straight", cache, *COMMON, *mode, "train.steps=4")
    train(tmp_path, "resumed", cache, *COMMON, *mode, "train.steps=2")
    resumed = train(tmp_path, "resumed", cache, *COMMON, *mode, "train.steps=4")
    for key in KEYS:
        assert len(resumed[key]) == len(straight[key]) == 4, (key, resumed, straight)
        assert resumed[key][2:] == straight[key][2:], f"{key} after the resume: {resumed[key]} vs {straight[key]}"
        assert resumed[key][:2] == straight[key][:2], f"{key} before the stop: {resumed[key]} vs {straight[key]}"
    log = (tmp_path / "resumed" / "train.log").read_text()
    assert "resumed from" in log and "step_00000002 at step 2" in log, log[-3000:]
    saved = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000002", "step_00000004"]
