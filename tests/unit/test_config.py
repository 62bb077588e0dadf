"""Every config in every group composes and validates; bad input fails with a message naming the key."""

from __future__ import annotations

import dataclasses

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from hlat.config import ConfigError, ModelConfig, RunConfig, to_run_config
from tests.conftest import CONF, compose_cfg

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
CASES = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_options() -> None:
    assert {"model", "optimizer", "precision", "data", "cluster", "tracker", "parallelism", "experiment"} <= set(GROUPS)
    assert {("model", m) for m in ("tiny", "small", "7b", "70b")} <= set(CASES)


@pytest.mark.parametrize(("group", "option"), CASES)
def test_every_option_composes_and_validates(group: str, option: str) -> None:
    cfg = to_run_config(compose_cfg(f"{group}={option}"))
    assert isinstance(cfg, RunConfig)
    if group != "experiment":
        assert getattr(cfg, group).name == option


def test_default_is_the_tiny_cpu_mlflow_run() -> None:
    cfg = to_run_config(compose_cfg())
    assert (cfg.model.name, cfg.cluster.backend, cfg.tracker.kind, cfg.data.path) == ("tiny", "torch", "mlflow", None)


def test_paper_optimizer_defaults() -> None:
    o = to_run_config(compose_cfg("experiment=hlat_7b")).optimizer
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad_norm) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_norms_and_biases) == (3e-4, 3e-5, 2000, True)
    assert to_run_config(compose_cfg("experiment=hlat_70b")).optimizer.lr == 1.5e-4


def test_beta2_override() -> None:
    assert to_run_config(compose_cfg("optimizer.beta2=0.99")).optimizer.beta2 == 0.99


def test_unknown_group_option_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException, match="modle"):
        compose_cfg("modle=tiny")


def test_unknown_key_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("model.dimm=3")
    assert isinstance(e.value.__cause__, ConfigKeyError) or "dimm" in str(e.value)


def test_wrong_type_fails_at_composition() -> None:
    with pytest.raises((ValidationError, ConfigCompositionException), match=r"model\.dim"):
        compose_cfg("model.dim=wide")


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["model.n_kv_heads=3"], ["model.n_heads", "model.n_kv_heads"]),
        (["model.dim=250"], ["model.dim", "model.n_heads"]),
        (
            ["train.global_batch_size=12", "train.micro_batch_size=8"],
            ["train.global_batch_size", "train.micro_batch_size"],
        ),
        (["train.seq_len=4096", "model.max_seq_len=2048"], ["train.seq_len", "model.max_seq_len"]),
        (["optimizer.warmup_steps=500"], ["optimizer.warmup_steps", "train.steps"]),
        (["optimizer.min_lr=1.0"], ["optimizer.min_lr"]),
        (["optimizer.beta2=1.5"], ["optimizer.beta2"]),
        (["precision.compute_dtype=float16"], ["precision.compute_dtype"]),
        (["cluster.backend=jax"], ["cluster.backend"]),
    ],
)
def test_cross_field_errors_name_the_keys(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        to_run_config(compose_cfg(*overrides))
    for key in keys:
        assert key in str(e.value)


def test_configs_are_frozen_after_validation() -> None:
    cfg = to_run_config(compose_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.dim = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg.model, dim=512).dim == 512


def test_every_schema_field_has_a_short_docstring() -> None:
    # Every config module's dataclasses (the schema users read in `hlat --help` and docs): a field without its docs,
    # or with an essay, is caught; the count keeps the walk from silently finding nothing.
    import ast
    from pathlib import Path

    import hlat.config as package

    checked = 0
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
            if cls.name == "RunConfig":
                continue
            body = cls.body
            for i, node in enumerate(body):
                if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                    continue
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                where = f"{path.name}: {cls.name}.{node.target.id}"
                assert documented, f"{where} has no docstring"
                assert nxt.end_lineno - nxt.lineno < 2, f"{where}: field docs take one or two lines"
                checked += 1
    assert checked > 100, checked


def test_model_kv_heads_default_is_multi_head() -> None:
    assert ModelConfig(n_heads=8, n_kv_heads=None).kv_heads == 8
