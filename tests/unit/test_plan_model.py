"""The step-time model's arithmetic against hand-computed values (hlat.plan.step_model)."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from hlat.config import ConfigError, RunConfig, to_run_config
from hlat.parallel import ParallelDims
from hlat.plan.memory import param_count
from hlat.plan.step_model import (
    CPT_TOKENS,
    Hardware,
    bubble_fraction,
    cost_per_tokens,
    dp_peers_in_node,
    estimate_step,
    hardware_flops_per_token,
    ring_all_gather_s,
    ring_all_reduce_s,
)
from hlat.track.metrics import Throughput, flops_per_token
from tests.conftest import compose_cfg

GB = 1e9
# A round-number node: 8 devices of 100 TFLOP/s, 100 GB/s in the node, 400 Gbit/s = 50 GB/s between nodes.
HW = Hardware(
    instance_type="test",
    devices_per_node=8,
    peak_flops=100e12,
    intra_node_bw=100 * GB,
    inter_node_bw=50 * GB,
    memory_bw=1000 * GB,
    price_per_hour=10.0,
    compute_efficiency=0.5,
    intra_node_efficiency=1.0,
    inter_node_efficiency=1.0,
    grad_reduce_overlap=0.0,
)


def cfg_of(*overrides: str) -> RunConfig:
    return to_run_config(
        compose_cfg(
            "model=7b",
            "precision=bf16",
            "train.seq_len=4096",
            "train.global_batch_size=64",
            "train.micro_batch_size=1",
            *overrides,
        )
    )


def step(cfg: RunConfig, world: int, hw: Hardware = HW):
    dims = ParallelDims.build(cfg.parallelism, world, cfg.model, cfg.train)
    return estimate_step(cfg, dims, hw, param_count(cfg.model)), dims


def test_ring_collectives() -> None:
    # 1 GB over 8 ranks at 100 GB/s: an all-reduce moves 2 * 7/8 GB per rank, an all-gather 7/8 GB
    assert ring_all_reduce_s(1 * GB, 8, 100 * GB) == pytest.approx(0.0175)
    assert ring_all_gather_s(1 * GB, 8, 100 * GB) == pytest.approx(0.00875)
    assert ring_all_reduce_s(1 * GB, 1, 100 * GB) == ring_all_gather_s(1 * GB, 1, 100 * GB) == 0.0


def test_bubble_fraction_of_1f1b() -> None:
    assert bubble_fraction(8, 256) == pytest.approx(7 / 263)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 16) == 0.0


def test_cost_per_4m_tokens() -> None:
    # 64 trn1 nodes at $21.50/h, 1M tokens/s: 4M tokens take 4 s = 64 * 21.5 * 4 / 3600 USD
    assert cost_per_tokens(21.5, 64, 1e6) == pytest.approx(64 * 21.5 * 4 / 3600)
    assert CPT_TOKENS == 4e6


def test_mfu_and_cpt_use_the_trainers_conventions() -> None:
    cfg = cfg_of("parallelism.tp=8", "parallelism.sequence_parallel=true")
    s, _ = step(cfg, 16)
    m = cfg.model
    n = param_count(m)
    trainer = Throughput(
        flops_per_token=flops_per_token(n, m.vocab_size * m.dim, m.n_layers, m.n_heads, m.head_dim, 4096),
        flops_per_token_causal=0.0,
        peak_flops=16 * HW.peak_flops,
        cost_per_hour=2 * HW.price_per_hour,
    ).metrics(s.tokens_per_s)
    assert s.mfu == pytest.approx(trainer["perf/mfu"])
    assert s.cost_per_4m_tokens == pytest.approx(trainer["perf/cost_per_4m_tokens"])
    assert s.nodes == 2 and s.tokens_per_step == 64 * 4096


def test_recomputed_flops_by_checkpointing_mode() -> None:
    n = param_count(cfg_of().model)
    attn_fwd = 4 * 32 * 4096 * 4096  # 4·L·h·T: QK^T and AV forward, full T x T as in flops_per_token
    model, none = hardware_flops_per_token(cfg_of(), n)
    assert none == 0.0 and model == 6 * (n - 32000 * 4096) + 3 * attn_fwd
    assert hardware_flops_per_token(cfg_of("parallelism.activation_checkpointing=selective"), n)[1] == attn_fwd
    blocks = n - 2 * 32000 * 4096 - 4096
    assert hardware_flops_per_token(cfg_of("parallelism.activation_checkpointing=full"), n)[1] == 2 * blocks + attn_fwd


def test_compute_and_tensor_parallel_terms() -> None:
    cfg = cfg_of(
        "parallelism.tp=8", "parallelism.sequence_parallel=true", "parallelism.activation_checkpointing=selective"
    )
    s, dims = step(cfg, 16)
    model, extra = hardware_flops_per_token(cfg, param_count(cfg.model))
    assert s.compute_s == pytest.approx((model + extra) * 64 * 4096 / 16 / (100e12 * 0.5))
    assert s.recompute_s == pytest.approx(extra * 64 * 4096 / 16 / (100e12 * 0.5))
    # 8 all-gathers/reduce-scatters of the (4096, 1, 4096) bf16 activation per layer, 32 layers, 32 micro-batches
    act = 4096 * 4096 * 2  # bf16 compute
    assert dims.grad_accum(cfg.train) == 32
    assert s.tp_comm_s == pytest.approx(8 * 7 / 8 * act / (100 * GB) * 32 * 32)
    full = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, activation_checkpointing="full"))
    assert step(full, 16)[0].tp_comm_s == pytest.approx(1.5 * s.tp_comm_s)  # the recomputed forward's 4 more


def test_data_parallel_reduction_is_hierarchical() -> None:
    cfg = cfg_of("parallelism.tp=2", "parallelism.sequence_parallel=true")
    s, dims = step(cfg, 32)  # 4 nodes; dp 16, of which 4 share a node
    assert dp_peers_in_node(dims, 8) == 4
    grads = param_count(cfg.model) / 2 * 2  # bf16 gradients of half the model
    intra = 2 * 3 / 4 * grads / (100 * GB)  # reduce-scatter + all-gather among the 4 in the node
    inter = 2 * 3 / 4 * (grads / 4) / (50 * GB / 8)  # ring over 4 nodes, 1/8 of the node's network each
    assert s.dp_comm_s == pytest.approx(intra + inter) and s.dp_exposed_s == s.dp_comm_s
    zero1 = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, zero1=True))
    z = step(zero1, 32)[0]  # reduce-scatter the gradients, all-gather the bf16 parameters: the same volume here
    assert z.dp_comm_s == pytest.approx(intra / 2 + inter / 2 + intra / 2 + inter / 2)


def test_overlap_hides_at_most_one_micro_batch_backward() -> None:
    cfg = cfg_of("parallelism.tp=2", "parallelism.sequence_parallel=true")
    s, dims = step(cfg, 32, dataclasses.replace(HW, grad_reduce_overlap=1.0))
    backward_last = s.compute_s / dims.grad_accum(cfg.train) * 2 / 3
    assert s.dp_exposed_s == pytest.approx(s.dp_comm_s - min(s.dp_comm_s, backward_last))
    assert s.dp_exposed_s < s.dp_comm_s


def test_pipeline_bubble_and_sends() -> None:
    cfg = cfg_of("parallelism.tp=8", "parallelism.pp=4", "parallelism.sequence_parallel=true")
    s, dims = step(cfg, 64)  # 8 nodes: tp 8 fills a node, dp 2, stages 16 ranks apart: across nodes
    m = dims.grad_accum(cfg.train)
    assert (dims.dp, m) == (2, 32)
    assert s.bubble_s == pytest.approx((s.compute_s + s.tp_comm_s) * 3 / m)
    act = 4096 * 4096 * 2 / 8  # one stage's output, split over tp by sequence parallelism
    assert s.pp_p2p_s == pytest.approx(2 * (m + 3) * act / (50 * GB / 8))
    total = sum(s.components().values())
    assert s.step_s == pytest.approx(total)


def test_optimizer_step_streams_the_states_once() -> None:
    cfg = cfg_of(
        "parallelism.tp=8", "parallelism.sequence_parallel=true", "precision=master_weights", "parallelism.zero1=true"
    )
    s, _ = step(cfg, 16)
    n = param_count(cfg.model) / 8 / 2  # ZeRO-1 over dp 2
    assert s.optimizer_s == pytest.approx(n * (4 + 2 * 2 + 2 * (8 + 4)) / (1000 * GB))


def test_hardware_needs_the_model_fields() -> None:
    with pytest.raises(ConfigError, match=r"cluster=cpu has no cluster.peak_tflops, cluster.intra_node_gb_s"):
        Hardware.of(to_run_config(compose_cfg()).cluster)
    hw = Hardware.of(to_run_config(compose_cfg("cluster=trn1_x64")).cluster)
    assert hw.peak_flops == 95e12 and hw.inter_node_bw == 100 * GB and hw.devices_per_node == 32
    assert hw.link_bw(cross_node=True) == pytest.approx(100 * GB / 32 * hw.inter_node_efficiency)


@pytest.mark.parametrize("key", ["compute_efficiency", "intra_node_efficiency", "inter_node_efficiency"])
def test_efficiencies_are_fractions(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"cluster.{key}=1.5 must lie in \(0, 1\]"):
        to_run_config(compose_cfg("cluster=trn1_1node", f"cluster.{key}=1.5"))
    with pytest.raises(ConfigError, match="grad_reduce_overlap"):
        to_run_config(compose_cfg("cluster=trn1_1node", "cluster.grad_reduce_overlap=-0.1"))


def test_gpu_and_trn1n_presets_describe_their_hardware() -> None:
    def c(name: str):
        return OmegaConf.to_object(compose_cfg(f"cluster={name}")).cluster

    p4d, p5, trn1n = c("p4d_x64"), c("p5_1node"), c("trn1n_1node")
    assert (p4d.nodes, p4d.peak_tflops * p4d.devices_per_node, p4d.price_per_hour) == (64, 2496, 32.77)  # paper §2
    assert (p4d.inter_node_gbit_s, p5.inter_node_gbit_s, trn1n.inter_node_gbit_s) == (400, 3200, 1600)
    assert (p5.peak_tflops, p5.device_memory_gib, trn1n.devices_per_node) == (989.4, 80, 32)
