"""Typed configuration schemas: one dataclass per config group, one docstring per field.

Hydra composes ``conf/`` against these schemas, so an unknown key or a wrong type fails at composition.
``run.main`` converts the composed config once with ``OmegaConf.to_object``; that call runs every
``__post_init__`` (the cross-field checks) and returns instances that are frozen from then on.
Nothing below ``run.py`` ever sees a ``DictConfig``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hlat.config.base import DTYPES, ConfigError, _check, _Frozen
from hlat.config.health import HealthConfig
from hlat.config.ops import ClusterConfig, EvalConfig, EvalTask, FaultConfig, TrackerConfig
from hlat.config.train import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PrecisionConfig,
    TrainConfig,
)

__all__ = [
    "DTYPES", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "EvalTask", "FaultConfig", "HealthConfig",
    "ModelConfig", "OptimizerConfig", "ParallelismConfig", "PrecisionConfig", "RunConfig", "TrackerConfig",
    "TrainConfig", "register_configs", "to_run_config",
]  # fmt: skip


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
    _register_resolvers()


def _console_level(level: str = "INFO") -> str:
    """``level`` on global rank 0, ``WARNING`` on the others (resolver of ``conf/hydra/job_logging/hlat.yaml``).

    Under any launcher (torchrun, srun, Slurm tasks, hlat's own) one rank narrates on the console; the others speak up
    on problems only, and keep their INFO lines in their own ``train_rank<N>.log``.
    """
    import os

    # hlat.train.launch.global_rank, read here: `hlat summary`'s Hydra logging must not import the launcher (nor torch)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    return level if rank == 0 else "WARNING"


def _launch_resolver(name: str) -> Callable[..., Any]:
    """``hlat.train.launch.<name>``, imported when a config first resolves it.

    ``hlat summary`` and ``hlat plan`` then compose without importing the launcher (and torch, through it).
    """

    def resolve(*args: Any) -> Any:
        from hlat.train import launch

        return getattr(launch, name)(*args)

    return resolve


def _register_resolvers() -> None:
    """Resolvers that keep ranks of one job in one directory (``hydra.run.dir``, ``hydra.sweep.dir``, logs)."""
    from omegaconf import OmegaConf

    for name, fn in (("hlat.job_stamp", _launch_resolver("job_stamp")),
                     ("hlat.rank_zero_only", _launch_resolver("rank_zero_only")),
                     ("hlat.rank_suffix", _launch_resolver("rank_suffix")),
                     ("hlat.console_level", _console_level)):  # fmt: skip
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "hlat.job_stamp")


def to_run_config(hydra_cfg: Any) -> RunConfig:
    """Validate the composed config once (every ``__post_init__`` runs) and return frozen dataclasses."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(hydra_cfg)
    assert isinstance(cfg, RunConfig), f"conf/config.yaml must start from base_config, got {type(cfg)}"
    return cfg
