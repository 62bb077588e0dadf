"""Precision modes: stochastic rounding, the low-precision AdamW, dtypes per mode, memory accounting."""

from __future__ import annotations

import copy

import pytest
import torch

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.precision import PrecisionAdamW, stochastic_round_bf16
from hlat.config import ClusterConfig, ConfigError, ModelConfig, OptimizerConfig, PrecisionConfig
from hlat.norms import grad_of
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from hlat.sizing import bytes_per_param
from tests.conftest import backend_config, compose_cfg

pytestmark = pytest.mark.bitwise  # chunked AdamW == torch's fused AdamW over whole tensors; SR bits

MODES = ("fp32", "autocast", "bf16", "bf16_sr", "master_weights")


def precision(name: str, *overrides: str) -> PrecisionConfig:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_cfg(f"precision={name}", *overrides)).precision


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 value (by magnitude truncation and one ulp up)."""
    bits = x.view(torch.int32) & -0x10000
    lo = bits.view(torch.float32)
    hi = (bits + 0x10000).view(torch.float32)
    return lo, hi


# --- stochastic rounding ---------------------------------------------------------------------------------------


def test_sr_returns_one_of_the_two_neighbours() -> None:
    x = torch.randn(100_000) * torch.logspace(-6, 6, 100_000)
    y = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    lo, hi = neighbours(x)
    assert y.dtype == torch.float32 and torch.all((y == lo) | (y == hi))
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round_bf16(exact).float(), exact)
    assert torch.isnan(stochastic_round_bf16(torch.tensor([float("nan")]))).all()


def test_sr_is_unbiased_where_round_to_nearest_is_not() -> None:
    # 1 + 0.3 ulp: round-to-nearest always returns 1.0 (bias -0.3 ulp); SR returns 1 + ulp 30% of the time.
    ulp = 2.0**-7
    x = torch.full((400_000,), 1.0 + 0.3 * ulp)
    gen = torch.Generator().manual_seed(1)
    sr = stochastic_round_bf16(x, gen).double()
    rne = x.to(torch.bfloat16).double()
    stderr = ulp * (0.3 * 0.7 / x.numel()) ** 0.5
    assert abs(sr.mean().item() - x[0].item()) < 5 * stderr  # unbiased within 5 standard errors
    assert abs(rne.mean().item() - x[0].item()) == pytest.approx(0.3 * ulp, rel=1e-3)  # biased by 0.3 ulp
    assert (sr == 1.0 + ulp).double().mean().item() == pytest.approx(0.3, abs=0.005)
    # Negative values and random magnitudes: the mean error is zero on average, also for negatives.
    x = -(torch.rand(400_000, generator=gen) * 10 + 1e-3)
    lo, hi = neighbours(x)
    err = (stochastic_round_bf16(x, gen).double() - x.double()) / (hi.double() - lo.double()).abs()  # in ulps
    assert abs(err.mean().item()) < 5 * err.std().item() / err.numel() ** 0.5


def test_sr_is_seeded() -> None:
    x = torch.randn(10_000)
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    b = stochastic_round_bf16(x, torch.Generator().manual_seed(7))
    c = stochastic_round_bf16(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_small_updates_vanish_under_round_to_nearest_and_accumulate_under_sr() -> None:
    # A weight of 1.0 (bf16 ulp 2^-7 = 0.0078) receives 1000 updates of +1e-4 (0.013 ulp each): +0.1 in total.
    w_rne = torch.ones(10_000, dtype=torch.bfloat16)
    w_sr = torch.ones(10_000, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(1000):
        w_rne = (w_rne.float() + 1e-4).to(torch.bfloat16)
        w_sr = stochastic_round_bf16(w_sr.float() + 1e-4, gen)
    assert torch.all(w_rne == 1.0)  # every update lost
    assert w_sr.float().mean().item() == pytest.approx(1.1, abs=0.002)


# --- the low-precision AdamW -----------------------------------------------------------------------------------


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in ((64, 32), (32,), (7, 5))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


KW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_precision_adamw_on_fp32_equals_torch_adamw() -> None:
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = PrecisionAdamW(
        ours, **KW, master_weights=False, state_dtype=torch.float32, stochastic_rounding=False, seed=0, chunk_numel=100
    )  # several chunks
    ref_opt = torch.optim.AdamW(ref, **KW, fused=True)
    for step in range(5):
        _grads(ours, step), _grads(ref, step)
        opt.step(), ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_master_weights_keep_fp32_state_and_round_the_copy() -> None:
    params = _params(torch.bfloat16)
    master_ref = [p.detach().float().clone().requires_grad_() for p in params]
    opt = PrecisionAdamW(
        params, **KW, master_weights=True, state_dtype=torch.bfloat16, stochastic_rounding=False, seed=0
    )
    ref_opt = torch.optim.AdamW(master_ref, **KW, fused=True)
    for step in range(5):
        _grads(params, step)
        for r, p in zip(master_ref, params, strict=True):
            r.grad = p.grad.float()
        opt.step(), ref_opt.step()
    for p, r in zip(params, master_ref, strict=True):
        st = opt.state[p]
        assert p.dtype == torch.bfloat16
        assert st["master"].dtype == st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(st["master"], r, rtol=0, atol=0)  # the master is torch's fp32 AdamW
        assert torch.equal(p, r.detach().to(torch.bfloat16))  # the model copy is its round-to-nearest


@pytest.mark.parametrize("sr", [False, True])
def test_pure_bf16_state_and_reproducible_rounding(sr: bool) -> None:
    def run() -> list[torch.Tensor]:
        params = _params(torch.bfloat16)
        opt = PrecisionAdamW(
            params, **KW, master_weights=False, state_dtype=torch.bfloat16, stochastic_rounding=sr, seed=3
        )
        for step in range(3):
            _grads(params, step)
            opt.step()
        assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
        return [p.detach().clone() for p in params]

    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_state_dict_round_trip_keeps_fp32_master_and_resumes_identically() -> None:
    def make():
        params = _params(torch.bfloat16)
        return params, PrecisionAdamW(
            params, **KW, master_weights=True, state_dtype=torch.bfloat16, stochastic_rounding=True, seed=5
        )

    params, opt = make()
    for step in range(2):
        _grads(params, step)
        opt.step()
    saved_params, saved = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())  # as torch.save
    for step in range(2, 4):
        _grads(params, step)
        opt.step()
    params2, opt2 = make()
    with torch.no_grad():
        for p, s in zip(params2, saved_params, strict=True):
            p.copy_(s)
    opt2.load_state_dict(saved)
    assert opt2.state[params2[0]]["master"].dtype == torch.float32  # torch would have cast it to bf16
    for step in range(2, 4):
        _grads(params2, step)
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params, params2, strict=True))


# --- each mode on the torch backend ----------------------------------------------------------------------------

TINY = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=128, max_seq_len=32)
EXPECTED = {  # mode: (params, grads, moments, master)
    "fp32": (torch.float32, torch.float32, torch.float32, None),
    "autocast": (torch.float32, torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16, None),
    "bf16_sr": (torch.bfloat16, torch.bfloat16, torch.bfloat16, None),
    "master_weights": (torch.bfloat16, torch.float32, torch.float32, torch.float32),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_with_its_dtypes(mode: str) -> None:
    prec = precision(mode)
    opt_cfg = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=0)
    backend = TorchBackend(backend_config(model=TINY, cluster=ClusterConfig(), precision=prec, optimizer=opt_cfg))
    backend.setup()
    model = backend.build_model(ParallelDims(world_size=1, tp=1, pp=1, dp=1))
    opt = backend.build_optimizer(model, param_groups(model, opt_cfg))
    p_dtype, g_dtype, m_dtype, master = EXPECTED[mode]
    assert model.rope_cos.dtype == torch.float32  # the rotary tables stay fp32 in every mode
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (4, 17), generator=gen)
    losses = []
    for _ in range(8):
        for _ in range(2):  # two micro-batches: exercises the (fp32) accumulation
            loss = backend.loss(model, tokens[:, :-1], tokens[:, 1:]) / 2
            assert loss.dtype == torch.float32 and loss.ndim == 0
            loss.backward()
        losses.append(loss.item() * 2)
        assert {grad_of(p).dtype for p in model.parameters()} == {g_dtype}
        norm = backend.clip_grad_norm(model, 1.0)
        assert norm.dtype == torch.float32 and torch.isfinite(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(grad_of(p) is None for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {p_dtype}
    state = opt.state[next(model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == m_dtype
    assert (state["master"].dtype if "master" in state else None) == master
    assert losses[-1] < losses[0] - 0.3, losses  # it learns the fixed batch


def test_fp32_softmax_ce_is_honoured() -> None:
    backend = TorchBackend(backend_config(model=TINY, cluster=ClusterConfig(), precision=precision("bf16")))
    backend.setup()
    model = backend.build_model(ParallelDims(world_size=1, tp=1, pp=1, dp=1))
    tokens = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens[:, :-1]).flatten(0, 1)
        low = backend.loss(model, tokens[:, :-1], tokens[:, 1:])
        backend.precision = precision("bf16", "precision.fp32_softmax_ce=true")
        high = backend.loss(model, tokens[:, :-1], tokens[:, 1:])
    ref = torch.nn.functional.cross_entropy(logits.double(), tokens[:, 1:].flatten())
    assert high.item() == pytest.approx(ref.item(), abs=1e-5)
    assert low.item() != high.item()


# --- config and memory accounting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["precision=fp32", "precision.master_weights=true"], "precision.master_weights"),
        (["precision=autocast", "precision.stochastic_rounding=true"], "precision.stochastic_rounding"),
        (["precision=fp32", "precision.fp32_grad_accum=false"], "precision.fp32_grad_accum"),
        (["precision=fp32", "precision.fp32_softmax_ce=false"], "precision.fp32_softmax_ce"),
        (["precision=bf16", "precision.compute_dtype=float32"], "precision.param_dtype"),
    ],
)
def test_invalid_precision_combinations_are_config_errors(overrides: list[str], key: str) -> None:
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match=key):
        OmegaConf.to_object(compose_cfg(*overrides))


def test_modes_compose_with_the_fp32_operations() -> None:
    p = precision("bf16_sr", "precision.fp32_grad_accum=true", "precision.fp32_softmax_ce=true")
    assert p.stochastic_rounding and p.fp32_grad_accum and p.fp32_softmax_ce


def test_bytes_per_param_per_mode() -> None:
    got = {m: bytes_per_param(precision(m)) for m in MODES}
    assert {m: (b.params, b.grads, b.optimizer, b.master, b.total) for m, b in got.items()} == {
        "fp32": (4, 4, 8, 0, 16),
        "autocast": (4, 4, 8, 0, 16),
        "bf16": (2, 2, 4, 0, 8),
        "bf16_sr": (2, 2, 4, 0, 8),
        "master_weights": (2, 4, 8, 4, 18),
    }
    assert bytes_per_param(precision("bf16", "precision.fp32_grad_accum=true")).grads == 4
    assert got["master_weights"].as_params()["memory.bytes_per_param.total"] == 18


def test_zero1_shards_optimizer_and_master_in_the_estimate() -> None:
    from omegaconf import OmegaConf

    from hlat.plan.memory import estimate_memory

    cfg = OmegaConf.to_object(compose_cfg("model=70b", "precision=master_weights"))
    n, est = estimate_memory(cfg, ParallelDims(world_size=1024, tp=32, pp=8, dp=4))
    assert est.params == n * 2 // 256 and est.grads == n * 4 // 256 and est.optimizer == n * 12 // 256
    cfg = OmegaConf.to_object(compose_cfg("model=70b", "precision=master_weights", "parallelism.zero1=true"))
    _, est = estimate_memory(cfg, ParallelDims(world_size=1024, tp=32, pp=8, dp=4))
    assert est.optimizer == n * 12 // (256 * 4)


def test_activation_estimate_follows_korthikanti_with_sp_checkpointing_and_pp() -> None:
    """Table 2 of Korthikanti et al. for 7B shapes (s=4096, b=1, h=4096, a=32, L=32), at 16-bit."""
    from omegaconf import OmegaConf

    from hlat.plan.memory import activation_bytes

    def act(tp: int, pp: int, *overrides: str) -> float:
        batch = ("train.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=1024")
        cfg = OmegaConf.to_object(compose_cfg("model=7b", *batch, *overrides, f"parallelism.tp={tp}"))
        return activation_bytes(cfg, ParallelDims(world_size=tp * pp * 4, tp=tp, pp=pp, dp=4))

    sbh, L = 4096 * 4096, 32
    assert act(1, 1) == L * sbh * (34 + 5 * 32)
    assert act(8, 1) == L * sbh * (10 + (24 + 160) / 8)  # TP without SP: layer norms and dropouts replicated
    assert act(8, 1, "parallelism.sequence_parallel=true") == L * sbh * 194 / 8
    assert act(8, 1, "parallelism=hlat_7b") == L * sbh * 34 / 8  # + selective: the attention core is recomputed
    full = act(8, 1, "parallelism=hlat_7b", "parallelism.activation_checkpointing=full")
    assert full == L * 2 * sbh / 8 + sbh * 34 / 8  # layer inputs, plus one layer while it is recomputed
    assert act(1, 4) == act(1, 1)  # 1F1B: L/pp layers x pp micro-batches in flight on the first stage
