"""The decoder against reference math: causality, GQA, init, parameter counts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from hlat.config import ModelConfig
from hlat.eval.kv_cache import decode, new_cache
from hlat.model import Transformer, count_params
from tests.conftest import compose_cfg

TINY = ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)


def build(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def reference_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Textbook LLaMA math with separate q/k/v, an explicit mask and repeated kv heads (HF style)."""
    cfg = model.cfg
    B, T = tokens.shape
    H, G, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    r = H // G
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # (B, T, h, D)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    h = model.embed.weight.double()[tokens]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for layer in model.layers:
        w = layer.attn.qkv.weight.double().view(G, r + 2, D, cfg.dim)
        wq, wk, wv = (
            w[:, :r].reshape(H * D, cfg.dim),
            w[:, r].reshape(G * D, cfg.dim),
            w[:, r + 1].reshape(G * D, cfg.dim),
        )
        x = rms(h, layer.attn_norm.weight.double())
        q = rope((x @ wq.T).view(B, T, H, D))
        k = rope((x @ wk.T).view(B, T, G, D)).repeat_interleave(r, dim=2)
        v = (x @ wv.T).view(B, T, G, D).repeat_interleave(r, dim=2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D) + mask
        y = torch.einsum("bhts,bshd->bthd", att.softmax(-1), v).reshape(B, T, H * D)
        h = h + y @ layer.attn.o_proj.weight.double().T
        x = rms(h, layer.mlp_norm.weight.double())
        gate, up = (x @ layer.mlp.gate_up.weight.double().T).chunk(2, -1)
        h = h + (F.silu(gate) * up) @ layer.mlp.down.weight.double().T
    return rms(h, model.norm.weight.double()) @ model.lm_head.weight.double().T


def test_matches_reference_math() -> None:
    model = build()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)  # make the norm scales matter
        tokens = torch.randint(0, TINY.vocab_size, (2, 17))
        torch.testing.assert_close(model(tokens).double(), reference_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_causal_future_tokens_never_change_past_logits() -> None:
    model = build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 7, 22):
            changed = tokens.clone()
            changed[:, t + 1 :] = torch.randint(0, TINY.vocab_size, changed[:, t + 1 :].shape)
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])  # and the future does see them


def test_mask_leak_lets_each_position_see_exactly_that_many_future_tokens() -> None:
    # The switch of the information-leak experiment: it must really leak (else that experiment shows nothing),
    # and by exactly mask_leak tokens per layer (one layer here); the causal test above guards the default.
    for leak in (1, 2):
        model = build(dataclasses.replace(TINY, mask_leak=leak, n_layers=1))
        tokens = torch.randint(0, TINY.vocab_size, (2, 24))
        with torch.no_grad():
            base = model(tokens)
            changed = tokens.clone()
            changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size  # one token changes
            out = model(changed)
        torch.testing.assert_close(out[:, : 10 - leak], base[:, : 10 - leak], atol=1e-5, rtol=1e-5)
        for t in range(10 - leak, 10):  # the positions that see position 10 through the leak
            assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.bitwise  # leak 0 must take the causal kernel itself
def test_leaky_core_with_no_leak_is_the_causal_model() -> None:
    # held_out.py scores a leaky model "with causal attention" by setting its cores' leak to 0: that must be
    # exactly the causal model's forward, not an approximation of it.
    causal, leaky = build(), build(dataclasses.replace(TINY, mask_leak=1))
    leaky.load_state_dict(causal.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        assert not torch.allclose(leaky(tokens), causal(tokens))
        for layer in leaky.layers:
            layer.attn.core.leak = 0
        assert torch.equal(leaky(tokens), causal(tokens))


@pytest.mark.bitwise  # an unpadded decode from position 0 is the training forward
def test_left_padded_batch_with_mask_matches_each_row_alone() -> None:
    model = build()
    lengths = [11, 4, 7, 1]
    width = max(lengths)
    rows = [torch.randint(0, TINY.vocab_size, (n,)) for n in lengths]
    tokens = torch.full((len(rows), width), 5, dtype=torch.long)  # pads: a real token id, masked out
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, width - len(row) :], mask[i, width - len(row) :] = row, True
    with torch.no_grad():
        cache = new_cache(model, width + 3)
        batched = decode(model, tokens, cache, mask)  # (B, width, V)
        assert not batched.isnan().any()  # pad queries attend to themselves: no empty mask row
        nxt = torch.randint(0, TINY.vocab_size, (len(rows), 3))
        steps = [decode(model, nxt[:, t : t + 1], cache) for t in range(3)]  # decoding extends the mask with True
        assert cache.key_mask is not None and cache.key_mask[:, : width + 3].sum(1).tolist() == [n + 3 for n in lengths]
        for i, row in enumerate(rows):
            alone = model(torch.cat([row, nxt[i]])[None])[0]  # (n + 3, V): unpadded, from position 0
            torch.testing.assert_close(batched[i, width - len(row) :], alone[: len(row)], atol=1e-5, rtol=0)
            for t in range(3):
                torch.testing.assert_close(steps[t][i, 0], alone[len(row) + t], atol=1e-5, rtol=0)
        cache.reset()  # a fresh unpadded sequence afterwards: no mask left over
        assert cache.key_mask is None and torch.equal(decode(model, tokens[:1], cache), model(tokens[:1]))


def test_gqa_shapes() -> None:
    model = build()
    attn = model.layers[0].attn
    assert attn.qkv.weight.shape == ((8 + 2 * 2) * 8, 64)  # 8 query heads, 2 kv heads, head_dim 8
    assert attn.o_proj.weight.shape == (64, 64)
    assert model.layers[0].mlp.gate_up.weight.shape == (2 * 96, 64)
    assert model(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 101)


def test_mha_equals_gqa_with_all_heads() -> None:
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=None, ffn_dim=48, vocab_size=50, max_seq_len=16)
    model = build(cfg)
    tokens = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).double(), reference_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_scaled_init_std_per_layer() -> None:
    cfg = ModelConfig(dim=512, n_layers=4, n_heads=8, ffn_dim=1024, vocab_size=512, max_seq_len=8, init_std=0.021)
    model = build(cfg)
    for layer in model.layers:
        scaled = 0.021 / math.sqrt(2 * layer.layer_id)
        for w, expected in (
            (layer.attn.o_proj.weight, scaled),
            (layer.mlp.down.weight, scaled),
            (layer.attn.qkv.weight, 0.021),
            (layer.mlp.gate_up.weight, 0.021),
        ):
            assert w.std().item() == pytest.approx(expected, rel=0.03)
        assert torch.all(layer.attn_norm.weight == 1)
    assert model.embed.weight.std().item() == pytest.approx(0.021, rel=0.03)
    unscaled = build(dataclasses.replace(cfg, scaled_init=False))
    assert unscaled.layers[3].attn.o_proj.weight.std().item() == pytest.approx(0.021, rel=0.03)


def test_meta_build_then_init_is_deterministic() -> None:
    a, b = build(seed=3), build(seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert "rope_cos" not in a.state_dict()  # derived buffers are not checkpointed


@pytest.mark.parametrize(("name", "expected"), [("7b", 6_738_415_616), ("70b", 68_976_648_192)])
def test_paper_model_param_counts_on_meta(name: str, expected: int) -> None:
    from hlat.config import to_run_config

    assert count_params(to_run_config(compose_cfg(f"model={name}")).model) == expected


def test_bf16_autocast_forward_backward() -> None:
    model = build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_initialization_is_keyed_by_seed_and_name_not_by_draw_order() -> None:
    """Every weight is drawn from its own (seed, name) generator: a model that initializes a layer alone, or after
    other random draws, gets the same values (what lets TP/PP layouts and NxD's per-stage materialization start from
    the flat model's weights), and another seed gives other weights."""
    from hlat.model import init_normal, init_stds

    a, b, c = Transformer(TINY), Transformer(TINY), Transformer(TINY)
    a.init_weights(3)
    torch.rand(1000)  # consume the global generator: must not matter
    b.init_weights(3)
    c.init_weights(4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    std = init_stds(TINY)
    last = f"layers.{TINY.n_layers - 1}.mlp.down.weight"
    alone = init_normal(3, last, a.get_parameter(last).shape, std[last])
    assert torch.equal(alone, a.get_parameter(last))
    assert std[last] < std["layers.0.mlp.down.weight"]  # scaled init: std / sqrt(2 l)
    torch.manual_seed(5)
    b.init_weights()
    torch.manual_seed(5)
    c.init_weights()
    assert all(torch.equal(x, y) for x, y in zip(b.parameters(), c.parameters(), strict=True))
