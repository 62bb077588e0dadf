"""train.init_from: a new run starts from another run's (or an imported Hugging Face model's) weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hlat import checkpoint
from hlat.checkpoint import weights
from hlat.config import ConfigError
from hlat.eval import hf
from hlat.train.run import main
from tests.conftest import run_config
from tests.integration.test_train import SMALL_RUN

pytestmark = pytest.mark.slow


def test_a_run_starts_from_exported_and_imported_weights(tmp_path: Path, cache_dir: Path) -> None:
    common = [
        *SMALL_RUN,
        "train.steps=3",
        "train.checkpoint_every=3",
        f"data.cache_dir={cache_dir}",
        "tracker=console",
        "tracker.plots=false",
        "optimizer.warmup_steps=1",
        "health=off",
    ]
    main(run_config(*common), run_dir=tmp_path / "a")
    source = tmp_path / "a" / "checkpoints"
    _, trained, ckpt = weights.load_checkpoint_weights(source)
    hf.export_hf(ckpt, tmp_path / "hf")
    hf.import_hf_checkpoint(tmp_path / "hf", tmp_path / "imported")
    tokenizer = weights.checkpoint_tokenizer(tmp_path / "imported")

    with pytest.raises(ConfigError, match=r"holds weights only .* train.init_from="):
        checkpoint.resolve(str(tmp_path / "imported"))
    with pytest.raises(ConfigError, match=r"was trained with the tokenizer .* set data.tokenizer="):
        main(run_config(*common, f"train.init_from={tmp_path / 'imported'}"), run_dir=tmp_path / "b")

    # lr 1e-12: AdamW moves each weight by ~1e-12, far below an fp32 ulp of these weights
    main(
        run_config(
            *common,
            f"train.init_from={tmp_path / 'imported'}",
            f"data.tokenizer={tokenizer}",
            "optimizer.lr=1e-12",
            "optimizer.min_lr=1e-13",
        ),
        run_dir=tmp_path / "c",
    )
    _, started, _ = weights.load_checkpoint_weights(tmp_path / "c" / "checkpoints")
    assert trained.keys() == started.keys()
    for k in trained:
        torch.testing.assert_close(started[k], trained[k], rtol=0, atol=1e-9, msg=k)
    fresh = main(run_config(*common, "tracker=console"), run_dir=tmp_path / "d").history.series("train/loss")
    warm = main(
        run_config(*common, f"train.init_from={source}", f"data.tokenizer={tokenizer}"), run_dir=tmp_path / "e"
    ).history.series("train/loss")  # from a run's own checkpoints root
    assert warm[0][1] < fresh[0][1] - 0.05  # it starts where run a ended, not from a fresh initialization
