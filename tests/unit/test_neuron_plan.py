"""Config -> Neuron environment and NxD config (backends/neuron_plan.py), exactly, for the paper's two recipes.

Expected values come from NxD 0.17's code (``trainer/trainer.py``, ``pipeline/model.py``), HLAT's own scripts
(github.com/awslabs/HLAT), the Neuron docs' PyTorch NeuronX environment variables and arXiv 2404.10630 §3.5.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
from omegaconf import OmegaConf

from hlat.backends import get_backend
from hlat.backends.neuron import neuron_env, nxd_config_kwargs
from hlat.backends.neuron_model import NeuronAttentionCore, NeuronBlock
from hlat.backends.neuron_plan import model_options
from hlat.config import ConfigError, RunConfig
from hlat.parallel import ParallelDims
from tests.conftest import compose_cfg

HLAT_7B = ("experiment=hlat_7b", "cluster=trn1_x64", "parallelism=hlat_7b")
HLAT_70B = ("experiment=hlat_70b", "cluster=trn1_x32", "parallelism=hlat_70b")
INIT = object()  # stands for the param_init_fn


@functools.lru_cache
def cfg(*overrides: str) -> RunConfig:
    return OmegaConf.to_object(compose_cfg(*overrides))


def test_hlat_7b_environment() -> None:
    assert neuron_env(cfg(*HLAT_7B)) == {
        "NEURON_CC_FLAGS": "--model-type transformer --distribution-strategy=llm-training "
        "--enable-mixed-precision-accumulation",
        "NEURON_COMPILE_CACHE_URL": "/var/tmp/neuron-compile-cache",
        "NEURON_FUSE_SOFTMAX": "1",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3",
        "MALLOC_ARENA_MAX": "64",
        "XLA_USE_BF16": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_SEED": "1234",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
    }


def test_hlat_70b_environment() -> None:
    assert neuron_env(cfg(*HLAT_70B)) == {
        "NEURON_CC_FLAGS": "--model-type transformer --distribution-strategy=llm-training "
        "--enable-mixed-precision-accumulation",
        "NEURON_COMPILE_CACHE_URL": "/var/tmp/neuron-compile-cache",
        "NEURON_FUSE_SOFTMAX": "1",
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "31",
        "MALLOC_ARENA_MAX": "128",
        "XLA_DOWNCAST_BF16": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0",
        "XLA_DISABLE_FUNCTIONALIZATION": "0",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
    }


def test_hlat_7b_nxd_config() -> None:
    assert nxd_config_kwargs(cfg(*HLAT_7B), param_init_fn=INIT) == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
        "pipeline_config": None,
        "optimizer_config": {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0},
        "activation_checkpoint_config": NeuronAttentionCore,
        "sequence_parallel": True,
        "model_init_config": {"sequential_move_factor": 11, "meta_device_init": True, "param_init_fn": INIT},
        "mixed_precision_config": {
            "use_master_weights": False,
            "use_fp32_grad_acc": False,
            "use_master_weights_in_ckpt": False,
        },
    }


def test_hlat_70b_nxd_config() -> None:
    # 32 nodes x 32 cores = 1024 ranks / (TP32 x PP8) = DP 4; 1024 sequences / (1 x 4) = 256 micro-batches.
    assert nxd_config_kwargs(cfg(*HLAT_70B), param_init_fn=INIT) == {
        "tensor_parallel_size": 32,
        "pipeline_parallel_size": 8,
        "pipeline_config": {
            "transformer_layer_cls": NeuronBlock,
            "num_microbatches": 256,
            "output_loss_value_spec": True,
            "input_names": ["input_ids", "labels"],
            "auto_partition": True,
            "leaf_module_cls": ["NeuronRMSNorm", "TokenLoss"],
            "tracer_cls": "torch",
            "use_zero1_optimizer": True,
            "use_optimizer_wrapper": True,
            "broadcast_and_average_loss": True,
        },
        "optimizer_config": {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        "activation_checkpoint_config": NeuronAttentionCore,
        "sequence_parallel": True,
        "model_init_config": {"sequential_move_factor": 11, "meta_device_init": True, "param_init_fn": INIT},
        "mixed_precision_config": {
            "use_master_weights": True,
            "use_fp32_grad_acc": True,
            "use_master_weights_in_ckpt": True,
        },
    }


def test_model_options_of_the_recipes() -> None:
    seven, seventy = model_options(cfg(*HLAT_7B)), model_options(cfg(*HLAT_70B))
    # 7B: MHA over TP8, bf16 everywhere (XLA_USE_BF16); 70B: 8 kv heads x4 = TP32, fp32 (float64) where it matters.
    assert (seven.kv_size_multiplier, seven.reduce_dtype, seven.upcast_dtype, seven.fp32_softmax_ce) == (
        1,
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert (seventy.kv_size_multiplier, seventy.reduce_dtype, seventy.upcast_dtype, seventy.fp32_softmax_ce) == (
        4,
        torch.float32,
        torch.float64,
        True,
    )
    assert seven.sequence_parallel and seventy.sequence_parallel


def test_single_node_or_no_efa_means_no_efa_variables() -> None:
    one = neuron_env(cfg(*HLAT_7B, "cluster.nodes=1", "train.global_batch_size=16"))
    no_efa = neuron_env(cfg(*HLAT_7B, "cluster.efa_devices=0"))
    assert not {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE"} & (set(one) | set(no_efa))


def test_compile_cache_follows_the_cluster_config_and_stays_out_of_the_compiler_flags() -> None:
    """The cache's location is NEURON_COMPILE_CACHE_URL alone (HLAT's scripts): the flags, whose hash is part of a
    cache entry's key, must not change with it, or entries copied from a staging cache to a node's disk could miss."""
    env = neuron_env(cfg(*HLAT_7B, "cluster.compile_cache=/scratch/neff"))
    assert env["NEURON_COMPILE_CACHE_URL"] == "/scratch/neff"
    assert env["NEURON_CC_FLAGS"] == neuron_env(cfg(*HLAT_7B))["NEURON_CC_FLAGS"]
    assert "--cache_dir" not in env["NEURON_CC_FLAGS"]


@pytest.mark.parametrize(
    ("mode", "expected"), [("none", None), ("full", NeuronBlock), ("selective", NeuronAttentionCore)]
)
def test_activation_checkpointing_maps_to_module_classes(mode: str, expected: type | None) -> None:
    kw = nxd_config_kwargs(cfg(*HLAT_7B, f"parallelism.activation_checkpointing={mode}"), param_init_fn=INIT)
    assert kw["activation_checkpoint_config"] is expected


def test_no_clipping_still_reports_a_grad_norm() -> None:
    # NxD computes optimizer.grad_norm only when it clips: "no clipping" is an infinite limit.
    kw = nxd_config_kwargs(cfg(*HLAT_7B, "optimizer.clip_grad_norm=0"), param_init_fn=INIT)
    assert kw["optimizer_config"] == {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": math.inf}


def test_skip_step_and_master_weights_without_zero1_are_refused() -> None:
    with pytest.raises(ConfigError, match="skip_step cannot be honoured on the neuron backend"):
        neuron_env(cfg(*HLAT_7B, "train.on_nonfinite=skip_step"))
    with pytest.raises(ConfigError, match=r"needs parallelism\.zero1=true"):
        neuron_env(cfg(*HLAT_70B, "parallelism.zero1=false"))


def test_get_backend_builds_the_neuron_backend_of_the_run_config_and_imports_no_xla() -> None:
    backend = get_backend(cfg(*HLAT_7B))
    assert backend.name == "neuron" and not {"torch_xla", "neuronx_distributed"} & set(sys.modules)


def test_data_parallel_rank_follows_nxds_pp_dp_tp_layout() -> None:
    # NxD: rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank. With TP2 x PP2 x DP2, ranks 0-3 are the first stage.
    dims = ParallelDims(world_size=8, tp=2, pp=2, dp=2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [ParallelDims(world_size=4, tp=1, pp=1, dp=4).dp_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_nxd_cpu_mode_preset_sets_the_variable_and_refuses_other_backends() -> None:
    """``cluster=nxd_cpu`` exports NXD_CPU_MODE=1 (NxD reads it to keep tensors on the CPU and talk over gloo) and
    PJRT_DEVICE=CPU; the flag on a non-neuron or a Neuron-device cluster is a config error naming the fix."""
    env = neuron_env(cfg("cluster=nxd_cpu", "parallelism.tp=2"))
    assert env["NXD_CPU_MODE"] == "1" and env["PJRT_DEVICE"] == "CPU"
    assert "NXD_CPU_MODE" not in neuron_env(cfg("cluster=xla_cpu"))
    for bad in (("cluster=cpu", "cluster.nxd_cpu_mode=true"), ("cluster=trn1_1node", "cluster.nxd_cpu_mode=true")):
        with pytest.raises(ConfigError, match="cluster=nxd_cpu"):
            cfg(*bad)


def test_per_layer_grad_norms_are_refused_with_tensor_or_pipeline_parallelism() -> None:
    """Each rank holds other shards and stages, so the per-layer norms averaged over ranks would be wrong: refused."""
    for layout in ("parallelism.tp=2", "parallelism.pp=2"):
        with pytest.raises(ConfigError, match="layer_grad_norms_every"):
            neuron_env(cfg("cluster=nxd_cpu", layout, "tracker.layer_grad_norms_every=5"))
    neuron_env(cfg("cluster=xla_cpu", "tracker.layer_grad_norms_every=5"))  # one rank holds everything: allowed
