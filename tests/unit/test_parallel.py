"""ParallelDims arithmetic."""

from __future__ import annotations

import pytest

from hlat.config import ConfigError, ModelConfig, ParallelismConfig, TrainConfig
from hlat.parallel import ParallelDims

M7 = ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000)
PAPER_7B = TrainConfig(seq_len=4096, global_batch_size=1024, micro_batch_size=1)


def test_paper_7b_layout() -> None:
    # 64 trn1.32xlarge nodes x 32 NeuronCores, TP=8 -> DP=256; 1024 sequences -> 4 micro-batches per rank.
    dims = ParallelDims.build(ParallelismConfig(tp=8), 64 * 32, M7, PAPER_7B)
    assert (dims.tp, dims.pp, dims.dp, dims.grad_accum(PAPER_7B)) == (8, 1, 256, 4)


def test_single_process() -> None:
    train = TrainConfig(global_batch_size=16, micro_batch_size=8)
    dims = ParallelDims.build(ParallelismConfig(), 1, M7, train)
    assert (dims.dp, dims.grad_accum(train)) == (1, 2)


@pytest.mark.parametrize(
    ("par", "world", "model", "train", "key"),
    [
        (ParallelismConfig(tp=8), 12, M7, PAPER_7B, "parallelism.tp"),
        (ParallelismConfig(tp=64), 64, M7, PAPER_7B, "model.n_heads"),
        (ParallelismConfig(pp=5), 5, M7, PAPER_7B, "model.n_layers"),
        (
            ParallelismConfig(tp=8),
            8 * 3,
            M7,
            TrainConfig(global_batch_size=16, micro_batch_size=8),
            "train.global_batch_size",
        ),
    ],
)
def test_bad_layouts_name_the_key(par, world, model, train, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ParallelDims.build(par, world, model, train)
