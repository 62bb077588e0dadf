"""Parallel layout arithmetic: how a world of ranks splits into tensor, pipeline and data parallelism.

Pure Python, no collectives: backends turn a validated ``ParallelDims`` into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.config import ConfigError, ModelConfig, ParallelismConfig, TrainConfig


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees; ``tp * pp * dp == world_size``."""

    world_size: int
    tp: int
    pp: int
    dp: int

    @classmethod
    def build(cls, par: ParallelismConfig, world_size: int, model: ModelConfig, train: TrainConfig) -> ParallelDims:
        """Derive the data-parallel degree and check every divisibility rule against the model and batch.

        Raises:
            ConfigError: naming the keys involved and how to fix them.
        """
        tp, pp = par.tp, par.pp
        if world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallelism.tp={tp} x parallelism.pp={pp}; "
                "choose degrees whose product divides the number of ranks"
            )
        if model.n_heads % tp or model.kv_heads % tp:
            raise ConfigError(
                f"parallelism.tp={tp} must divide model.n_heads={model.n_heads} and the kv heads ({model.kv_heads}); "
                "lower parallelism.tp"
            )
        if model.n_layers % pp:
            raise ConfigError(
                f"parallelism.pp={pp} must divide model.n_layers={model.n_layers}; choose another pipeline degree"
            )
        dp = world_size // (tp * pp)
        per_step = train.micro_batch_size * dp
        if train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={train.global_batch_size} is not divisible by "
                f"train.micro_batch_size={train.micro_batch_size} x data-parallel degree {dp}; "
                f"use a global batch that is a multiple of {per_step}"
            )
        return cls(world_size=world_size, tp=tp, pp=pp, dp=dp)

    def grad_accum(self, train: TrainConfig) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        return train.global_batch_size // (train.micro_batch_size * self.dp)
