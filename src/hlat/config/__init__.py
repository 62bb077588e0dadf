"""Typed configuration schemas: one dataclass per config group, one docstring per field.

Hydra composes ``conf/`` against them; :func:`to_run_config` runs every ``__post_init__`` once and freezes the
result. Owns the schemas, ``compose``, ``resolvers`` (rank, job stamp) and ``suggest`` ("did you mean").
The bottom layer: may import nothing of hlat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hlat.config.base import DTYPES, ConfigError, UnknownKeyError, _check, _Frozen, flatten
from hlat.config.health import HealthConfig
from hlat.config.mix import MixSourceConfig, MixStageConfig, check_schedule
from hlat.config.ops import ClusterConfig, EvalConfig, EvalTask, FaultConfig, TrackerConfig
from hlat.config.resolvers import register_resolvers
from hlat.config.train import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    TrainConfig,
)

__all__ = [
    "DTYPES",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "EvalTask",
    "FaultConfig",
    "HealthConfig",
    "MixSourceConfig",
    "MixStageConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrackerConfig",
    "TrainConfig",
    "flatten",
    "register_configs",
    "to_run_config",
    "to_yaml",
]


@dataclass
class RunConfig(_Frozen):
    """The whole composed configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        t, m, o = self.train, self.model, self.optimizer
        _check(
            t.seq_len <= m.max_seq_len,
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len",
        )
        _check(
            t.global_batch_size % t.micro_batch_size == 0,
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size}; make the global batch a multiple of the micro batch",
        )
        if self.data.mixed:
            check_schedule(self.data.mix, self.data.stages, t.steps, t.global_batch_size * t.seq_len)
        _check(
            o.warmup_steps < t.steps or t.dry_run,
            f"optimizer.warmup_steps={o.warmup_steps} is not below train.steps={t.steps}: the run would end "
            "before reaching the peak learning rate; lower optimizer.warmup_steps or raise train.steps",
        )
        self._freeze()


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore as ``base_config`` (the first entry of conf/config.yaml)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    register_resolvers()


def to_run_config(hydra_cfg: Any) -> RunConfig:
    """Validate the composed config once (every ``__post_init__`` runs) and return frozen dataclasses."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_object(hydra_cfg)
    except UnknownKeyError as e:  # a key appended with '+': name the closest existing one
        from hlat.config.suggest import unknown_key

        raise ConfigError(unknown_key(RunConfig, e.cls, e.name, e.value)) from None
    assert isinstance(cfg, RunConfig), f"conf/config.yaml must start from base_config, got {type(cfg)}"
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    """The run's config as YAML, as Hydra writes the resolved composed config (``OmegaConf.to_yaml``)."""
    import dataclasses

    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
