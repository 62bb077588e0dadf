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
                f"world size {world_size} is not divisible by parallelism.tp={tp} x parallelism.pp={pp}: start a "
                f"multiple of {tp * pp} ranks (cluster.nproc_per_node, or torchrun --nproc-per-node) or choose "
                f"degrees that divide {world_size} (tp in {valid_tp(model, world_size)})"
            )
        kv = model.kv_heads
        if model.n_heads % tp or (kv % tp and tp % kv):
            raise ConfigError(
                f"parallelism.tp={tp} does not fit model.n_heads={model.n_heads} with {kv} kv heads: tp must divide "
                "the query heads and either divide the kv heads (each rank gets whole kv groups) or be a multiple of "
                f"them (kv heads replicated, as NxD's kv_size_multiplier); valid: {valid_tp(model, world_size)}"
            )
        if par.sequence_parallel and train.seq_len % tp:
            raise ConfigError(
                f"parallelism.sequence_parallel splits the sequence over tp={tp} ranks, but train.seq_len="
                f"{train.seq_len} is not divisible by {tp}; use a multiple of {tp}"
            )
        if model.n_layers % pp:
            raise ConfigError(
                f"parallelism.pp={pp} must divide model.n_layers={model.n_layers}; set parallelism.pp to one of "
                f"{[d for d in range(1, model.n_layers + 1) if model.n_layers % d == 0]}"
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

    def kv_replicas(self, model: ModelConfig) -> int:
        """How many tensor-parallel ranks hold a copy of each kv head (1 unless tp exceeds the kv heads)."""
        return max(1, self.tp // model.kv_heads)

    def grad_accum(self, train: TrainConfig) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        return train.global_batch_size // (train.micro_batch_size * self.dp)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel replica of global ``rank`` (which data stream it reads)."""
        # Ranks are laid out [pp, dp, tp] row-major, NxD's order (parallel_state.py): tp innermost stays in a node.
        return (rank // self.tp) % self.dp


def valid_tp(model: ModelConfig, world_size: int) -> list[int]:
    """Tensor-parallel degrees that fit ``model`` (heads and kv heads) and divide ``world_size``."""
    kv = model.kv_heads
    return [
        t
        for t in range(1, world_size + 1)
        if world_size % t == 0 and model.n_heads % t == 0 and (kv % t == 0 or t % kv == 0)
    ]


TP_PLAN: dict[str, str] = {
    "layers.*.attn.qkv": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up": "colwise",
    "layers.*.mlp.down": "rowwise",
    "embed": "rowwise",
    "lm_head": "colwise",
}
"""How tensor parallelism splits each weight, as data for both backends: colwise the output features, rowwise the
input features (the embedding's vocabulary) with a sum over ranks; norms are replicated or sequence-parallel."""
