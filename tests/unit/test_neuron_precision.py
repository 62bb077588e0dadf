"""The Neuron precision mapping (backends/neuron.py), checked against NxD's Llama example and the Neuron docs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from hlat.backends.neuron import apply_env, precision_plan
from hlat.config import ConfigError, RunConfig
from tests.conftest import compose_cfg


def cfg(*overrides: str) -> RunConfig:
    return OmegaConf.to_object(compose_cfg(*overrides))


def plan(*overrides: str):
    c = cfg(*overrides)
    return precision_plan(c.precision, c.parallelism, c.train.seed)


def test_bf16_is_xla_use_bf16_without_sr() -> None:
    p = plan("precision=bf16")
    assert p.env == {"XLA_USE_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"}
    assert p.mixed_precision_config == {
        "use_master_weights": False,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }
    assert not p.autocast and p.reduce_dtype == "bfloat16"


def test_bf16_sr_is_the_hlat_7b_setting_with_a_seed() -> None:
    p = plan("precision=bf16_sr", "train.seed=77")
    assert p.env == {
        "XLA_USE_BF16": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_SEED": "77",
    }
    assert "--enable-mixed-precision-accumulation" in p.cc_flags
    assert not p.mixed_precision_config["use_master_weights"]


def test_master_weights_is_downcast_sr_off_and_nxd_mixed_precision() -> None:
    p = plan("precision=master_weights", "parallelism.zero1=true")
    assert p.env == {"XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"}
    assert "XLA_USE_BF16" not in p.env
    assert p.mixed_precision_config == {
        "use_master_weights": True,
        "use_fp32_grad_acc": True,
        "use_master_weights_in_ckpt": True,
    }
    assert p.upcast_dtype == "float64"  # doubles are the fp32 of XLA_DOWNCAST_BF16
    assert p.reduce_dtype == "float32"


def test_the_users_70b_command_maps_to_mixed_precision_with_zero1() -> None:
    # `python train.py model=70b precision=master_weights` composes; the paper's 70B recipe brings ZeRO-1.
    c = cfg("model=70b", "precision=master_weights")
    assert (c.model.name, c.precision.name, c.precision.master_weights) == ("70b", "master_weights", True)
    p = plan("experiment=hlat_70b")
    assert p.mixed_precision_config["use_master_weights"] and p.env["XLA_DOWNCAST_BF16"] == "1"


def test_fp32_and_autocast_set_no_xla_variable() -> None:
    fp32, auto = plan("precision=fp32"), plan("precision=autocast")
    assert fp32.env == auto.env == {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"}
    assert fp32.cc_flags == ("--auto-cast=none",) and not fp32.autocast
    assert auto.autocast and auto.cc_flags == ("--auto-cast=none", "--enable-mixed-precision-accumulation")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["precision=master_weights"], "needs parallelism.zero1=true"),
        (["precision=bf16_sr", "precision.fp32_grad_accum=true"], "fp32_grad_accum=true .* needs parallelism.zero1"),
        (["precision=bf16_sr", "precision.fp32_softmax_ce=true"], "XLA_USE_BF16=1 turns every float and double"),
        (["precision=bf16", "precision.fp32_reduce=true"], "precision.fp32_reduce=true cannot be honoured"),
    ],
)
def test_combinations_neuron_cannot_honour_are_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(*overrides)


def test_bf16_sr_with_fp32_grad_accum_is_fine_under_zero1() -> None:
    p = plan("precision=bf16_sr", "precision.fp32_grad_accum=true", "parallelism.zero1=true")
    assert p.mixed_precision_config["use_fp32_grad_acc"] and p.env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"


def test_apply_env_sets_variables_and_refuses_after_torch_xla_import(monkeypatch) -> None:
    monkeypatch.delitem(os.environ, "XLA_USE_BF16", raising=False)
    apply_env({"XLA_USE_BF16": "1"})
    assert os.environ["XLA_USE_BF16"] == "1"
    monkeypatch.setitem(sys.modules, "torch_xla", object())
    with pytest.raises(RuntimeError, match="before torch_xla is imported"):
        apply_env({"XLA_USE_BF16": "1"})


def test_importing_the_neuron_module_needs_no_neuron_package() -> None:
    code = "import sys, hlat.backends.neuron; assert not {'torch_xla', 'neuronx_distributed'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_checkpoint_calls_map_onto_nxd_save_and_load(tmp_path) -> None:
    from hlat.backends.neuron import checkpoint_calls

    extra = {"train_state": {"step": 7}}
    save, load = checkpoint_calls(tmp_path / "step_00000007.tmp", extra, async_save=True, zero1=True)
    assert save == {
        "checkpoint_dir_str": str(tmp_path),
        "tag": "step_00000007.tmp",
        "user_content": extra,
        "use_xser": True,
        "async_save": True,
        "num_kept_ckpts": None,
        "zero1_optimizer": True,
    }
    assert load == {"path": str(tmp_path), "tag": "step_00000007.tmp"}
