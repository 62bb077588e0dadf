"""The decoder on NxD parallel layers (backends/neuron_model.py), on CPU through the FAKE layers (tp 1).

Oracle: hlat.model.Transformer with the same weights and F.cross_entropy. The fake layers have NxD's signatures and
NxD's sequence-parallel [S, B, H] layout, so both layouts run here; sharding itself (tp > 1) is NxD's and untested.
"""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hlat import parallel
from hlat.backends.neuron_model import (
    IGNORE_INDEX,
    ModuleInit,
    NeuronAttentionCore,
    NeuronModelOptions,
    NeuronTransformer,
    NxDLayers,
)
from hlat.backends.neuron_plan import RECOMPUTED, pipeline_config
from hlat.config import ModelConfig, ParallelismConfig
from hlat.model import Transformer, rope_tables
from hlat.parallel import TP_PLAN
from tests.fakes.neuron_api import (
    ColumnParallelLinear,
    FakeNeuronApi,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    _Recorded,
    parallel_cross_entropy,
    trace_like_nxd,
)

pytestmark = pytest.mark.bitwise  # recomputed gradients == saved ones, bit for bit

FAKE = NxDLayers(
    column=ColumnParallelLinear,
    row=RowParallelLinear,
    qkv=GQAQKVColumnParallelLinear,
    embedding=ParallelEmbedding,
    cross_entropy=parallel_cross_entropy,
)
CFG = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def options(sp: bool = False, **kw) -> NeuronModelOptions:
    base = {
        "sequence_parallel": sp,
        "kv_size_multiplier": 1,
        "reduce_dtype": torch.float32,
        "upcast_dtype": torch.float32,
        "fp32_softmax_ce": True,
    }
    return NeuronModelOptions(**(base | kw))


def reference() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.init_weights()
    return model


@torch.no_grad()
def twin(ref: Transformer, sp: bool) -> NeuronTransformer:
    """The neuron decoder holding ``ref``'s weights (the fused qkv regrouped from [q.. k v] per group to [q; k; v])."""
    model = NeuronTransformer(CFG, FAKE, options(sp))
    init = ModuleInit(CFG)
    for m in model.modules():
        init(m)
    G, r, D = CFG.kv_heads, CFG.n_heads // CFG.kv_heads, CFG.head_dim
    model.embed.weight.copy_(ref.embed.weight)
    model.lm_head.weight.copy_(ref.lm_head.weight)
    model.norm.weight.copy_(ref.norm.weight)
    for mine, theirs in zip(model.layers, ref.layers, strict=True):
        w = theirs.attn.qkv.weight.view(G, r + 2, D, CFG.dim)
        qkv = [w[:, :r].reshape(-1, CFG.dim), w[:, r].reshape(-1, CFG.dim), w[:, r + 1].reshape(-1, CFG.dim)]
        mine.attn.qkv.weight_qkv.copy_(torch.cat(qkv))
        for name in ("attn.o_proj", "mlp.gate_up", "mlp.down", "attn_norm", "mlp_norm"):
            mine.get_submodule(name).weight.copy_(theirs.get_submodule(name).weight)
    return model


def batch(size: int = 3, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CFG.vocab_size, (size, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("sp", [False, True])
def test_same_loss_and_gradients_as_the_reference_decoder(sp: bool) -> None:
    ref = reference()
    model = twin(ref, sp)
    x, y = batch()
    expected = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss = model(x, y)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    loss.backward()
    for name in ("layers.1.mlp.down.weight", "layers.0.attn.o_proj.weight", "embed.weight", "norm.weight"):
        torch.testing.assert_close(model.get_parameter(name).grad, ref.get_parameter(name).grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sp", [False, True])
def test_without_labels_the_forward_returns_the_reference_logits(sp: bool) -> None:
    """The contract shared with ``hlat.model.Transformer``: token ids (B, T) -> logits (B, T, V), batch first also
    under sequence parallelism (tp 1 here, so the vocabulary shard is the whole vocabulary)."""
    ref = reference()
    model = twin(ref, sp)
    x, y = batch()
    logits = model(x)
    torch.testing.assert_close(logits, ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x, y), F.cross_entropy(logits.flatten(0, 1), y.flatten()), rtol=1e-6, atol=0)


def test_parameter_names_and_order_are_the_torch_models() -> None:
    """Checkpoints, per-layer metrics, the optimizer's parameter order and the init-by-name key on these names."""
    theirs = [n.replace("attn.qkv.weight", "attn.qkv.weight_qkv") for n, _ in Transformer(CFG).named_parameters()]
    assert [n for n, _ in NeuronTransformer(CFG, FAKE, options()).named_parameters()] == theirs


@pytest.mark.parametrize(
    ("entry", "style", "message"),
    [
        ("layers.*.mlp.down", None, r"TP_PLAN has no entry for layers\.0\.mlp\.down"),
        ("embed", "colwise", r"TP_PLAN gives embed colwise, but NxD's ParallelEmbedding is rowwise: make it rowwise"),
        (
            "layers.*.attn.qkv",
            "rowwise",
            r"gives layers\.0\.attn\.qkv rowwise, but NxD's GQAQKVColumnParallelLinear is colwise",
        ),
    ],
)
def test_layers_follow_the_tp_plan(monkeypatch, entry: str, style: str | None, message: str) -> None:
    """``hlat.parallel.TP_PLAN`` picks each NxD layer: a changed entry changes the layer or is refused by name."""
    plan = {k: v for k, v in parallel.TP_PLAN.items() if k != entry} | ({entry: style} if style else {})
    monkeypatch.setattr(parallel, "TP_PLAN", plan)
    monkeypatch.setattr("hlat.backends.neuron_model.TP_PLAN", plan)
    with pytest.raises(ValueError, match=message):
        NeuronTransformer(CFG, FAKE, options())


def test_a_flipped_tp_plan_entry_flips_the_nxd_layer(monkeypatch) -> None:
    plan = parallel.TP_PLAN | {"layers.*.mlp.down": "colwise", "lm_head": "rowwise"}
    monkeypatch.setattr("hlat.backends.neuron_model.TP_PLAN", plan)
    model = NeuronTransformer(CFG, FAKE, options())
    assert type(model.layers[1].mlp.down) is ColumnParallelLinear and type(model.lm_head) is RowParallelLinear


def grads(ac: type[nn.Module] | None) -> dict[str, torch.Tensor]:
    """The gradients by name of one forward and backward, built by the fake's NxD with ``activation_checkpoint_config``
    ``ac``."""
    nxd_config = {
        "model_init_config": {"meta_device_init": True, "param_init_fn": ModuleInit(CFG)},
        "pipeline_parallel_size": 1,
        "activation_checkpoint_config": ac,
    }
    model = FakeNeuronApi().initialize_parallel_model(nxd_config, lambda: NeuronTransformer(CFG, FAKE, options()))
    x, y = batch()
    model(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_nxd_recomputes_the_mapped_modules_with_unchanged_names_and_gradients(monkeypatch, mode: str) -> None:
    """``RECOMPUTED`` names classes the decoder is built of: NxD wraps each of them (n_layers) and runs it again in
    the backward pass; names and gradients stay those of the run without recomputation."""
    ac = RECOMPUTED[mode]
    assert ac is not None
    calls: list[int] = []
    forward = ac.forward
    monkeypatch.setattr(ac, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    plain = grads(None)
    once = len(calls)
    recomputed = grads(ac)
    assert (once, len(calls) - once) == (CFG.n_layers, 2 * CFG.n_layers)  # forward, and again in the backward pass
    assert list(recomputed) == list(plain)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)


def test_ignored_labels_are_masked_by_hand() -> None:
    ref = reference()
    model = twin(ref, sp=False)
    x, y = batch()
    y = y.clone()
    y[0, :5] = IGNORE_INDEX
    y[2, -3:] = IGNORE_INDEX
    expected = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(model(x, y), expected, rtol=1e-5, atol=1e-5)


def test_attention_core_is_causal_softmax_attention_with_shared_kv() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8)
    core = NeuronAttentionCore(upcast_dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(core(q, k, v), expected, rtol=1e-5, atol=1e-6)
    # Causal: changing the last position's key and value leaves every earlier output unchanged.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 5.0, -5.0
    torch.testing.assert_close(core(q, k2, v2)[:, :, :-1], core(q, k, v)[:, :, :-1])


def test_every_tp_plan_entry_is_an_nxd_layer_with_the_reference_arguments(monkeypatch) -> None:
    api = FakeNeuronApi()
    monkeypatch.setattr(_Recorded, "api", api)
    model = NeuronTransformer(CFG, FAKE, options(sp=True, kv_size_multiplier=2, reduce_dtype=torch.bfloat16))
    kinds = {
        "colwise": (ColumnParallelLinear, GQAQKVColumnParallelLinear),
        "rowwise": (RowParallelLinear, ParallelEmbedding),
    }
    names = dict(model.named_modules())
    for pattern, kind in TP_PLAN.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        assert hits and all(isinstance(names[n], kinds[kind]) for n in hits), pattern
    assert not [n for n, m in names.items() if isinstance(m, (nn.Linear, nn.Embedding))]
    common = {"bias": False, "dtype": torch.float32, "sequence_parallel_enabled": True, "reduce_dtype": torch.bfloat16}
    qkv = api.first("GQAQKVColumnParallelLinear").kwargs
    assert qkv == common | {
        "input_size": 64,
        "output_sizes": [64, 32],
        "gather_output": False,
        "fuse_qkv": True,
        "kv_size_multiplier": 2,
        "init_method": qkv["init_method"],
    }
    columns = api.all("ColumnParallelLinear")
    assert [c.kwargs["stride"] for c in columns[:2]] == [2, 2]  # gate_up of each block; lm_head has stride 1
    assert all(c.kwargs["gather_output"] is False and c.kwargs["sequence_parallel_enabled"] for c in columns)
    rows = api.all("RowParallelLinear")
    assert len(rows) == 4 and all(r.kwargs["input_is_parallel"] is True for r in rows)
    assert api.first("ParallelEmbedding").kwargs["sequence_parallel_enabled"] is True
    # Scaled init (arXiv 2404.10630 §4.3): the output projections of layer l get std / sqrt(2 l).
    stds = [r.kwargs["init_method"].std for r in rows]
    assert stds == pytest.approx([0.021 / math.sqrt(2), 0.021 / math.sqrt(2), 0.021 / 2, 0.021 / 2])
    assert qkv["init_method"].std == 0.021
    norms = [model.norm, *(n for b in model.layers for n in (b.attn_norm, b.mlp_norm))]
    assert all(n.weight.sequence_parallel_enabled for n in norms)  # NxD all-reduces these gradients


@pytest.mark.parametrize("seed", [0, 7])
def test_param_init_gives_the_torch_models_weights_by_name(seed: int) -> None:
    """NxD's materialization (fake, TP 1) draws every weight by name: the neuron decoder starts from the weights
    ``Transformer.init_weights(seed)`` gives, the fused qkv regrouped, in any module order. Before keying by name
    GQAQKV drew q, k and v apart and the two backends started from different weights (step-1 loss 6.2540 vs 6.2506)."""
    ref = Transformer(CFG)
    ref.init_weights(seed)
    model = NeuronTransformer(CFG, FAKE, options(seed=seed))
    init = ModuleInit(CFG)
    for m in reversed(list(model.modules())):  # another order than construction: must not matter
        init(m)
    G, r, D = CFG.kv_heads, CFG.n_heads // CFG.kv_heads, CFG.head_dim
    for mine, theirs in zip(model.layers, ref.layers, strict=True):
        w = theirs.attn.qkv.weight.view(G, r + 2, D, CFG.dim)
        qkv = torch.cat([w[:, :r].reshape(-1, CFG.dim), w[:, r].reshape(-1, CFG.dim), w[:, r + 1].reshape(-1, CFG.dim)])
        assert torch.equal(mine.attn.qkv.weight_qkv, qkv)
        assert mine.attn.qkv.weight_qkv.tensor_model_parallel  # NxD's rebuilt Parameter gets its attributes back
        for name in ("attn.o_proj", "mlp.gate_up", "mlp.down", "attn_norm", "mlp_norm"):
            assert torch.equal(mine.get_submodule(name).weight, theirs.get_submodule(name).weight), name
    for name in ("embed", "lm_head", "norm"):
        assert torch.equal(model.get_submodule(name).weight, ref.get_submodule(name).weight), name


def test_meta_build_and_param_init_fill_every_parameter_and_the_rotary_tables() -> None:
    api = FakeNeuronApi()
    nxd_config = {
        "model_init_config": {"meta_device_init": True, "param_init_fn": ModuleInit(CFG)},
        "pipeline_parallel_size": 1,
        "activation_checkpoint_config": None,
    }
    model = api.initialize_parallel_model(nxd_config, lambda: NeuronTransformer(CFG, FAKE, options()))
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the fake NaN-fills before param_init_fn
    assert model.module.norm.weight.eq(1).all()
    cos, _ = rope_tables(CFG.head_dim, CFG.max_seq_len, CFG.rope_theta)
    torch.testing.assert_close(model.module.layers[1].attn.rope_cos, cos)
    std = model.module.layers[1].mlp.down.weight.std().item()
    assert 0.7 < std / (0.021 / 2) < 1.3  # scaled init: std / sqrt(2 * 2)


def test_traces_like_nxd_pipeline_with_blocks_as_stage_boundaries() -> None:
    ref = reference()
    model = twin(ref, sp=False)
    traced = trace_like_nxd(model, pipeline_config(ParallelismConfig(pp=2), num_microbatches=2))
    called = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert called == ["embed", "layers.0", "layers.1", "norm", "lm_head", "loss_fn"]
    x, y = batch()
    torch.testing.assert_close(traced(x, y), model(x, y))
