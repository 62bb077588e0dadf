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


GQA_70B = ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000)


def test_gqa_tp_beyond_the_kv_heads_replicates_them() -> None:
    # HLAT-70B: TP32 with 8 kv heads -> each kv head on 4 ranks (NxD kv_size_multiplier=4); PP8 over 80 layers.
    train = TrainConfig(seq_len=4096, global_batch_size=1024, micro_batch_size=1)
    dims = ParallelDims.build(ParallelismConfig(tp=32, pp=8, zero1=True), 256 * 32, GQA_70B, train)
    assert (dims.tp, dims.pp, dims.dp, dims.kv_replicas(GQA_70B)) == (32, 8, 32, 4)
    assert ParallelDims.build(ParallelismConfig(tp=4), 4, GQA_70B, train).kv_replicas(GQA_70B) == 1


def test_tp_that_splits_a_kv_group_is_refused_with_valid_values() -> None:
    model = ModelConfig(dim=768, n_layers=2, n_heads=12, n_kv_heads=4, ffn_dim=2048)
    with pytest.raises(ConfigError, match=r"parallelism\.tp=6 does not fit .* valid: \[1, 2, 4, 12\]"):
        ParallelDims.build(ParallelismConfig(tp=6), 12, model, TrainConfig(global_batch_size=8, micro_batch_size=1))


def test_sequence_parallel_needs_tp_and_a_divisible_sequence() -> None:
    with pytest.raises(ConfigError, match=r"sequence_parallel=true needs parallelism\.tp > 1"):
        ParallelismConfig(sequence_parallel=True)
    train = TrainConfig(seq_len=100, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(ConfigError, match=r"train\.seq_len=100 is not divisible by 8"):
        ParallelDims.build(ParallelismConfig(tp=8, sequence_parallel=True), 8, M7, train)
    assert ParallelDims.build(ParallelismConfig(tp=8, sequence_parallel=True), 8, M7, PAPER_7B).dp == 1
