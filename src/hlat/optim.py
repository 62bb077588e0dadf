"""AdamW parameter groups and the learning-rate schedule (linear warmup, cosine decay to a floor)."""

from __future__ import annotations

import math

from torch import nn

from hlat.config import OptimizerConfig


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Split parameters into decayed and non-decayed groups (1-D tensors), or one group as the paper decays all."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norms_and_biases:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based), a pure function of the step.

    Linear warmup reaches ``cfg.lr`` at step ``warmup_steps - 1``; cosine decay then runs for
    ``decay_steps`` (default: the rest of the run) down to ``cfg.min_lr``, and stays there.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
