"""The emulated bf16 matmul policy against an independent fp64 reference and against torch's native bf16 kernels.

The bounds asserted, and why:

- **One matmul** (linear forward and both backward products): the emulated result is an fp32 sum of exact products
  (bf16 x bf16 is exact in fp32) rounded once to bf16, so ``|emu - exact| <= 2^-8 |exact| + (1 + 2^-8) g_K S``
  with ``S = sum_k |a_k b_k|`` and ``g_K = K 2^-24 / (1 - K 2^-24)``, the standard bound of a K-term fp32 sum
  (Higham, eq. 3.5), and 2^-8 the unit roundoff of bf16's 8 significant bits. Accumulating in bf16, truncating
  instead of rounding, or rounding the operands twice each break it.
- **Attention**: the fp32 flash kernel's own error is far below bf16's, so the output is within one bf16 rounding
  (2^-8 relative) plus 1e-5 of the value scale of the exact result. Its gradients go through two bf16 roundings
  (the saved output, as the native kernel saves it, and the result): within 2^-7 of the exact ones in norm.
- **A whole model**: bf16 activations are rounded at every op (norms, residual adds, rotary, SiLU), which the
  policy does not touch; a forward/backward of a 2-layer model stays within 2^-5 in norm of the fp32 model on the
  same weights, natively or emulated (measured: 0.4-1.0%).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from hlat.backends.torch.bf16_matmul import apply_policy, emulated_linear, emulated_sdpa
from hlat.config import ConfigError, ModelConfig, ParallelismConfig, PrecisionConfig
from hlat.model import Linear, Transformer
from hlat.plan import bf16_policy
from hlat.plan.bf16_policy import resolve_policy

pytestmark = pytest.mark.bitwise  # emulated bf16 == the native kernels where results are exact

U = 2.0**-8  # unit roundoff of bf16


def _rand(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _matmul_bound(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product ``a @ b`` of bf16 matrices (fp64) and the bound on an fp32-accumulated, bf16-rounded one."""
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    k = a.shape[-1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return exact, U * exact.abs() + (1 + U) * gamma * (a64.abs() @ b64.abs())


def _assert_within(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    err = (result.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error {float((err - bound).max()):.3g} over the bound"
    # Not just inside the bound: almost every element is the correctly rounded value itself.
    assert float((result == exact.float().bfloat16()).float().mean()) > 0.99


def test_linear_forward_and_backward_are_correctly_rounded_fp32_sums() -> None:
    x = _rand(3, 40, 96, seed=1).requires_grad_()
    w = _rand(72, 96, scale=0.05, seed=2).requires_grad_()
    y = emulated_linear(x, w)
    assert y.dtype == torch.bfloat16
    exact, bound = _matmul_bound(x.detach().flatten(0, 1), w.detach().t())
    _assert_within(y.detach().flatten(0, 1), exact, bound)

    g = _rand(3, 40, 72, seed=3)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    assert gx.dtype == gw.dtype == torch.bfloat16
    exact, bound = _matmul_bound(g.flatten(0, 1), w.detach())  # dL/dx = g w
    _assert_within(gx.flatten(0, 1), exact, bound)
    exact, bound = _matmul_bound(g.flatten(0, 1).t(), x.detach().flatten(0, 1))  # dL/dw = g^T x, over 120 tokens
    _assert_within(gw, exact, bound)


def test_linear_agrees_with_the_native_kernel_and_keeps_fp32_inputs_fp32() -> None:
    x, w, b = _rand(2, 16, 64, seed=4), _rand(48, 64, scale=0.1, seed=5), _rand(48, seed=6)
    native, emulated = F.linear(x, w, b), emulated_linear(x, w, b)
    ulp = 2.0 ** (torch.floor(torch.log2(native.double().abs().clamp_min(1e-30))) - 7)
    assert bool(((native.double() - emulated.double()).abs() <= ulp).all())  # at most one rounding step apart
    assert float((native == emulated).float().mean()) > 0.99
    x32, w32 = x.float(), w.float()
    assert torch.equal(emulated_linear(x32, w32), F.linear(x32, w32))  # fp32 work is untouched


def test_linear_under_bf16_autocast_rounds_fp32_operands_like_autocast() -> None:
    # Small integers times 2^-4: every product and every partial sum is exact in fp32, so the native bf16 GEMM
    # (oneDNN, its own blocking) and the emulated fp32 one (MKL) reach the same fp32 sum in any order, on any ISA,
    # and both round it once to bf16. With random operands they could differ in the sum's last fp32 bit, which a
    # bf16 rounding hides almost always but not always (a tie): equality would hold by luck of the kernels.
    def exact(*shape: int, seed: int) -> torch.Tensor:
        ints = torch.randint(-64, 65, shape, generator=torch.Generator().manual_seed(seed))
        return (ints.float() / 16).requires_grad_()  # 7 significant bits: exact in bf16 as in fp32

    x, w = exact(4, 32, seed=7), exact(16, 32, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native, emulated = F.linear(x, w), emulated_linear(x, w)
    assert emulated.dtype == native.dtype == torch.bfloat16
    assert torch.equal(emulated, native)
    assert not torch.equal(emulated.float(), (x @ w.T).detach())  # the bf16 rounding of the sums really happened
    (gx, gw) = torch.autograd.grad(emulated.float().sum(), (x, w))
    assert gx.dtype == gw.dtype == torch.float32  # the gradients reach the fp32 leaves through the casts


def _attention_reference(q, k, v):
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    return out, (qq, kk, vv)


def test_attention_is_one_bf16_rounding_from_the_exact_result() -> None:
    q = _rand(2, 4, 48, 16, seed=9).requires_grad_()
    k, v = _rand(2, 2, 48, 16, seed=10).requires_grad_(), _rand(2, 2, 48, 16, seed=11).requires_grad_()
    out = emulated_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    exact, leaves = _attention_reference(q, k, v)
    bound = U * exact.detach().abs() + 1e-5 * float(v.detach().abs().max())
    assert out.dtype == torch.bfloat16 and bool(((out.double() - exact.detach()).abs() <= bound).all())

    g = _rand(*out.shape, seed=12)
    grads = torch.autograd.grad(out, (q, k, v), g)
    exact_grads = torch.autograd.grad(exact, leaves, g.double())
    native_grads = torch.autograd.grad(
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), g
    )
    for got, nat, ref in zip(grads, native_grads, exact_grads, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert float((got.double() - ref).norm() / ref.norm()) < 2 * U
        assert float((nat.double() - ref).norm() / ref.norm()) < 4 * U  # the native kernel: same regime


def test_masked_attention_falls_back_to_fp32_autograd() -> None:
    q, k, v = (_rand(1, 2, 8, 4, seed=s).requires_grad_() for s in (13, 14, 15))
    mask = torch.ones(8, 8, dtype=torch.bool).tril(1)  # a leaky mask, as model.mask_leak builds
    out = emulated_sdpa(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()
    assert torch.equal(out, ref)
    assert all(g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.float().sum(), (q, k, v)))


TINY = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)


def _forward_backward(model: Transformer, tokens: torch.Tensor):
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_a_whole_model_emulated_native_and_fp32_agree_within_bf16_rounding() -> None:
    torch.manual_seed(0)
    fp32 = Transformer(TINY)
    fp32.init_weights()
    with torch.no_grad():  # the fp32 reference on exactly the bf16 weights
        for p in fp32.parameters():
            p.copy_(p.bfloat16().float())
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    runs = {}
    for policy in ("native", "emulated"):
        model = copy.deepcopy(fp32).to(torch.bfloat16)
        model.init_rope()
        changed = 0 if policy == "native" else 5 * TINY.n_layers + 1  # 4 linears and attention a layer, the head
        assert apply_policy(model, policy) == changed
        runs[policy] = _forward_backward(model, tokens)
    runs["fp32"] = _forward_backward(fp32, tokens)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    for a, b in (("emulated", "fp32"), ("native", "fp32"), ("emulated", "native")):
        assert rel(runs[a][0], runs[b][0]) < 2**-5, (a, b)
        for name, grad in runs[b][1].items():
            assert rel(runs[a][1][name], grad) < 2**-5, (a, b, name)


def test_apply_policy_keeps_names_and_state_dict() -> None:
    model = Transformer(TINY)
    keys = list(model.state_dict())
    apply_policy(model, "emulated")
    assert list(model.state_dict()) == keys
    assert model.lm_head.linear is emulated_linear and type(model.lm_head) is Linear
    assert model.layers[0].attn.core.sdpa is emulated_sdpa
    assert apply_policy(Transformer(TINY), "native") == 0
    with pytest.raises(ValueError, match="resolved policy"):
        apply_policy(model, "auto")


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch):
    """Count probe calls and return the figures a test sets."""
    calls = []
    rates = {"float32": 150.0, "bf16_native": 1.0, "bf16_emulated": 140.0}

    def probe(device="cpu", **kw):
        calls.append(device)
        return dict(rates)

    monkeypatch.setattr(bf16_policy, "probe", probe)
    return calls, rates


def test_auto_takes_the_faster_measured_kernel_and_caches_it(tmp_path, fake_probe) -> None:
    calls, rates = fake_probe
    cpu = torch.device("cpu")
    policy, why = resolve_policy("auto", cpu, tmp_path)
    assert policy == "emulated" and "native 1.0 vs emulated 140.0" in why
    assert resolve_policy("auto", cpu, tmp_path)[0] == "emulated" and len(calls) == 1  # the cache answered
    (cache,) = tmp_path.glob("bf16-matmul-*.json")
    cache.write_text("{not json")  # a damaged cache is measured again, never trusted or fatal
    rates.update(bf16_native=420.0)  # a host with fast bf16 (e.g. avx512_bf16)
    assert resolve_policy("auto", cpu, tmp_path)[0] == "native" and len(calls) == 2
    assert json.loads(cache.read_text())["gflops"]["bf16_native"] == 420.0
    for forced in ("native", "emulated"):
        assert resolve_policy(forced, cpu, tmp_path) == (forced, f"precision.bf16_matmul={forced}")
    assert len(calls) == 2  # a forced policy probes nothing


def test_the_probe_measures_three_kernels() -> None:
    rates = bf16_policy.probe(n=64, budget_s=0.01)
    assert set(rates) == {"float32", "bf16_native", "bf16_emulated"} and all(r > 0 for r in rates.values())


def test_config_and_neuron_refuse_what_they_cannot_honour() -> None:
    with pytest.raises(ConfigError, match=r"precision\.bf16_matmul='fast'"):
        PrecisionConfig(bf16_matmul="fast")
    from hlat.backends.neuron_plan import precision_plan

    bf16 = dict(
        name="bf16",
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        fp32_grad_accum=False,
        fp32_reduce=False,
        fp32_softmax_ce=False,
    )
    with pytest.raises(ConfigError, match="bf16_matmul=auto"):
        precision_plan(PrecisionConfig(**bf16, bf16_matmul="emulated"), ParallelismConfig(), 0)
    precision_plan(PrecisionConfig(**bf16, bf16_matmul="native"), ParallelismConfig(), 0)  # the hardware's: fine


def test_stochastic_rounding_stays_unbiased_through_emulated_matmuls() -> None:
    """Updates 40x below half a bf16 step: round-to-nearest never moves the weights, stochastic rounding moves them
    by the fp32 update on average. Weights lie in [1, 2), one bf16 step 2^-7; 50 steps of lr 1e-4 expect a total
    move of 5e-3 per element, and the mean over 16384 elements has a rounding noise of ~4% of that (sd)."""
    from hlat.backends.torch.precision import PrecisionAdamW

    moved = {}
    for sr in (False, True):
        lin = Linear(256, 64, bias=False)
        with torch.no_grad():
            lin.weight.copy_(1.25 + 0.5 * torch.rand(64, 256, generator=torch.Generator().manual_seed(0)))
        lin.to(torch.bfloat16)
        assert apply_policy(lin, "emulated") == 1 and lin.linear is emulated_linear
        start = lin.weight.detach().float().clone()
        opt = PrecisionAdamW(
            lin.parameters(),
            lr=1e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            master_weights=False,
            state_dtype=torch.bfloat16,
            stochastic_rounding=sr,
            seed=3,
        )
        x = torch.rand(8, 256, generator=torch.Generator().manual_seed(1)).bfloat16()  # positive: every grad > 0
        for _ in range(50):
            lin(x).float().sum().backward()
            opt.step()
            opt.zero_grad()
        moved[sr] = float((start - lin.weight.detach().float()).mean()) / (50 * 1e-4)
    assert moved[False] == 0.0
    assert moved[True] == pytest.approx(1.0, abs=0.2)
