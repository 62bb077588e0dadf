"""Schedule values and parameter groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hlat.config import ModelConfig, OptimizerConfig
from hlat.model import Transformer
from hlat.optim import lr_at, param_groups

CFG = OptimizerConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000)


def test_warmup_is_linear_and_reaches_peak() -> None:
    assert lr_at(0, CFG, 450_000) == pytest.approx(3e-4 / 2000)
    assert lr_at(999, CFG, 450_000) == pytest.approx(1.5e-4)
    assert lr_at(1999, CFG, 450_000) == pytest.approx(3e-4)  # end of warmup
    assert lr_at(2000, CFG, 450_000) == pytest.approx(3e-4)  # start of decay


def test_cosine_midway_and_floor() -> None:
    total = 450_000
    mid = 2000 + (total - 2000) // 2
    assert lr_at(mid, CFG, total) == pytest.approx((3e-4 + 3e-5) / 2, rel=1e-6)
    assert lr_at(total, CFG, total) == pytest.approx(3e-5)
    assert lr_at(total + 10_000, CFG, total) == pytest.approx(3e-5)  # stays on the floor
    quarter = 2000 + (total - 2000) // 4
    assert lr_at(quarter, CFG, total) == pytest.approx(3e-5 + 2.7e-4 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-5)


def test_explicit_decay_steps() -> None:
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100)
    assert lr_at(110, cfg, 1000) == pytest.approx(0.1)
    assert lr_at(60, cfg, 1000) == pytest.approx(0.55)


def test_schedule_is_monotone_after_warmup() -> None:
    values = [lr_at(s, CFG, 10_000) for s in range(2000, 10_000, 97)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_param_groups_decay_everything_by_default() -> None:
    with torch.device("meta"):
        model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=48, vocab_size=64, max_seq_len=8))
    groups = param_groups(model, CFG)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    assert len(groups[0]["params"]) == len(list(model.parameters()))
    split = param_groups(model, OptimizerConfig(decay_norms_and_biases=False))
    assert [g["weight_decay"] for g in split] == [0.1, 0.0]
    assert all(p.ndim == 1 for p in split[1]["params"]) and len(split[1]["params"]) == 2 * 2 + 1  # norms
