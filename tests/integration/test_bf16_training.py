"""A bf16 training run gives the same loss curve with native and emulated bf16 matmuls, and says which it used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hlat.train.run import main
from tests.conftest import run_config

# Small enough that the native bf16 kernels (~1 GFLOP/s on an AVX2-only CPU) finish in seconds.
MICRO = [
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.steps=30",
    "train.log_every=1",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=3",
    "health=off",
    "train.checkpoint_every=0",
]


@pytest.mark.slow  # fast cover: test_a_bf16_run_says_which_policy_it_used below, tests/unit/test_bf16_matmul.py
def test_bf16_sr_trains_the_same_curve_with_either_policy(
    tmp_path: Path, cache_dir: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """precision=bf16_sr (HLAT-7B's mode) for 30 steps under each policy, from the same weights and batches.

    In this mode the loss itself is a bf16 number (fp32_softmax_ce=false): at a loss near 7, one bf16 step is
    2^-5. The two policies round the same values at the same places and differ only where an fp32 sum's order or
    attention's internal rounding tips a bf16 rounding; measured, the curves stay within one loss step of each
    other (3 of 30 steps differ at all). Asserted: every step within two bf16 steps of the loss (2^-7 relative) and
    the mean difference below a quarter step (2^-10 relative). A policy that broke a gradient or skipped a rounding
    diverges by far more within 30 steps.
    """
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    curves, runs = {}, {}
    for policy in ("native", "emulated"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hlat.plan.memory"):  # the summary line before a run
            result = main(
                run_config(
                    *MICRO,
                    "precision=bf16_sr",
                    f"precision.bf16_matmul={policy}",
                    f"data.cache_dir={cache_dir}",
                    "tracker.flush_every_s=0",
                ),
                run_dir=tmp_path / policy,
            )
        assert f"bf16 matmuls {policy} (precision.bf16_matmul={policy})" in caplog.text  # the summary line
        curves[policy] = [v for _, v in result.history.series("train/loss")]
        runs[policy] = result.mlflow_run_id
    native, emulated = curves["native"], curves["emulated"]
    assert len(native) == len(emulated) == 30 and native[0] == emulated[0]  # the same weights and first batch
    diffs = [abs(a - b) / a for a, b in zip(native, emulated, strict=True)]
    assert max(diffs) <= 2**-7 and sum(diffs) / len(diffs) <= 2**-10, diffs
    assert sum(emulated[-5:]) < sum(emulated[:5]) - 2.5  # it trains

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    for policy, run_id in runs.items():
        assert client.get_run(run_id).data.tags["precision.bf16_matmul"] == policy


def test_a_bf16_run_says_which_policy_it_used(
    tmp_path: Path, cache_dir: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two steps of precision=bf16_sr: the summary line and the MLflow tag name the policy (the kernels' numerics
    are tests/unit/test_bf16_matmul.py's; the 30-step curves under both policies are the slow test above)."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):  # the summary line, whichever hlat module logs it
        result = main(
            run_config(
                *MICRO,
                "train.steps=2",
                "optimizer.warmup_steps=1",
                "precision=bf16_sr",
                "precision.bf16_matmul=emulated",
                f"data.cache_dir={cache_dir}",
                "tracker.flush_every_s=0",
            ),
            run_dir=tmp_path / "bf16",
        )
    assert "bf16 matmuls emulated (precision.bf16_matmul=emulated)" in caplog.text
    assert len(result.history.series("train/loss")) == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(result.mlflow_run_id).data.tags["precision.bf16_matmul"] == "emulated"


def test_fp32_runs_are_tagged_without_a_bf16_policy(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    result = main(
        run_config(*MICRO, "train.steps=4", f"data.cache_dir={cache_dir}", "tracker.flush_every_s=0"),
        run_dir=tmp_path / "fp32",
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(result.mlflow_run_id).data.tags["precision.bf16_matmul"] == "n/a"
