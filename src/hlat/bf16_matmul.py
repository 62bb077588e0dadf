"""How bf16 matmuls run on the torch backend: natively, or emulated in fp32 where the host has no fast bf16 kernel.

On a CPU without bf16 matrix instructions (AVX2 only: most laptops, many cloud VMs and CI runners) torch's bf16
GEMM is a scalar fallback about 100x slower than fp32 (1024x1024 on a 2-core AVX2 EPYC: fp32 177 GFLOP/s, bf16
0.95). The **emulated** policy runs the matmul-heavy ops (every ``nn.Linear``, so the projections and the LM head
that makes the loss's logits, and scaled-dot-product attention) on bf16 tensors by upcasting the operands to fp32,
multiplying in fp32 and rounding the result to bf16, forward and backward. That is what bf16 hardware does: bf16
inputs are exact in fp32, products are summed in an fp32 accumulator, the output is rounded once to bf16. Results
agree with the native kernel up to the summation order (at most one bf16 rounding step per element apart).

Nothing else changes: parameters, gradients, AdamW state, stochastic rounding and memory per parameter stay what the
precision mode says. The custom autograd functions save their *bf16* inputs (upcast again in backward), so saved
activations are the same size as native bf16 ones; only attention under an explicit mask (decoding, the
information-leak experiment) falls back to autograd through fp32 copies.

The policy (``precision.bf16_matmul``): ``native``, ``emulated``, or ``auto``, decided by measurement rather than by
a list of CPU names: ``probe`` times a native bf16 GEMM against the emulated one on the run's device and ``auto``
takes the faster (``resolve_policy``), cached per host fingerprint (``hlat.host.host_fingerprint``) like the matmul
peak. The Neuron backend never uses this module: its bf16 is the hardware's (``XLA_USE_BF16``/``XLA_DOWNCAST_BF16``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hlat.model import AttentionCore

POLICIES = ("auto", "native", "emulated")
"""Values of ``precision.bf16_matmul``."""
PROBE_SIZE = 512
"""Side of the probe's square GEMMs: large enough to fill a vector unit, small enough that a slow bf16 fallback
(~1 GFLOP/s) still takes well under a second."""
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _EmulatedLinear(torch.autograd.Function):
    """``y = x w^T + b`` on bf16 tensors, computed in fp32 and rounded to bf16, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # bf16: the same saved memory as a native bf16 linear
        ctx.has_bias = bias is not None
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:  # (out, N) @ (N, in): the sum over every token in the fp32 accumulator
            gw = (g.flatten(0, -2).t() @ x.float().flatten(0, -2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.flatten(0, -2).sum(0).to(weight.dtype)
        return gx, gw, gb


class _EmulatedFlashCPU(torch.autograd.Function):
    """Unmasked attention on bf16 tensors through the CPU flash kernel in fp32, output rounded to bf16.

    Saves what the native bf16 kernel saves (bf16 q, k, v and output, the fp32 log-sum-exp) and calls the same
    kernel's backward on their fp32 upcasts, so the backward uses the bf16 output exactly as the native one does.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
    ) -> torch.Tensor:
        out, lse = _FLASH_CPU(q.float(), k.float(), v.float(), 0.0, is_causal, scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = _FLASH_CPU_BACKWARD(
            grad.float().contiguous(),
            q.float(),
            k.float(),
            v.float(),
            out.float(),
            lse,
            0.0,
            ctx.is_causal,
            scale=ctx.scale,
        )
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None


def _bf16_compute(device_type: str, *tensors: torch.Tensor | None) -> bool:
    """Whether an op on ``tensors`` computes in bf16: a bf16 operand, or bf16 autocast active on the device."""
    if any(t is not None and t.dtype == torch.bfloat16 for t in tensors):
        return True
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with bf16 semantics computed in fp32 (bf16 operands or bf16 autocast); else ``F.linear``.

    Under autocast the fp32 operands are first rounded to bf16, as autocast itself would.
    """
    device_type = x.device.type
    if not _bf16_compute(device_type, x, weight, bias):
        return F.linear(x, weight, bias)
    bf16 = torch.bfloat16
    with torch.autocast(device_type, enabled=False):
        return _EmulatedLinear.apply(x.to(bf16), weight.to(bf16), None if bias is None else bias.to(bf16))


def emulated_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with bf16 semantics computed in fp32; the plain call for fp32 inputs.

    Unmasked CPU attention (training) takes the flash kernel's fp32 forward and backward with bf16 saved tensors;
    anything else (a mask, dropout, another device) runs the fp32 op under autograd and rounds its output.
    """
    device_type = q.device.type
    if not _bf16_compute(device_type, q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    bf16 = torch.bfloat16
    with torch.autocast(device_type, enabled=False):
        q, k, v = q.to(bf16), k.to(bf16), v.to(bf16)
        if attn_mask is None and dropout_p == 0.0 and device_type == "cpu" and _FLASH_CPU is not None:
            return _EmulatedFlashCPU.apply(q, k, v, is_causal, scale)  # the kernel handles GQA's shared kv heads
        out = F.scaled_dot_product_attention(
            q.float(),
            k.float(),
            v.float(),
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.to(bf16)


class EmulatedBf16Linear(nn.Linear):
    """An ``nn.Linear`` whose bf16 matmuls run in fp32 (``emulated_linear``); made by ``apply_policy``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return emulated_linear(x, self.weight, self.bias)


def apply_policy(model: nn.Module, policy: str) -> int:
    """Make ``model``'s bf16 matmuls follow ``policy`` (``native``: nothing to do; ``emulated``), in place.

    Each plain ``nn.Linear`` becomes an ``EmulatedBf16Linear`` (a class swap, as ``hlat.recompute`` does: no name,
    parameter or hook changes, and tensor parallelism still sees an ``nn.Linear``), and each ``AttentionCore``
    calls ``emulated_sdpa``. Call before tensor parallelism, activation checkpointing and compilation.

    Returns:
        The number of modules changed.
    """
    if policy not in ("native", "emulated"):
        raise ValueError(f"apply_policy takes a resolved policy, 'native' or 'emulated', not {policy!r}")
    if policy == "native":
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = EmulatedBf16Linear
            changed += 1
        elif isinstance(module, AttentionCore):
            module.sdpa = emulated_sdpa
            changed += 1
    return changed


def _best_rate(fn: Callable[[], Any], flops: float, device: torch.device, budget_s: float) -> float:
    """The best FLOP/s of ``fn`` over a warm-up call and timed calls filling ``budget_s`` (at least one)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best, start = 0.0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        sync()
        best = max(best, flops / max(time.perf_counter() - t0, 1e-9))
        if time.perf_counter() - start > budget_s:
            return best


def probe(device: str | torch.device = "cpu", n: int = PROBE_SIZE, budget_s: float = 0.3) -> dict[str, float]:
    """GFLOP/s of an ``n×n`` GEMM in fp32, in native bf16 and in emulated bf16 (upcast, fp32 GEMM, round) here.

    Each is the best of repeated calls within ``budget_s``, after a warm-up call; the three are measured in
    one process back to back, so a busy machine slows all three alike.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(n, n, generator=gen).to(dev) for _ in range(2))
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    flops = 2.0 * n**3
    return {
        "float32": _best_rate(lambda: a32 @ b32, flops, dev, budget_s) / 1e9,
        "bf16_native": _best_rate(lambda: a16 @ b16, flops, dev, budget_s) / 1e9,
        "bf16_emulated": _best_rate(lambda: (a16.float() @ b16.float()).bfloat16(), flops, dev, budget_s) / 1e9,
    }


def _cache_file(cache_dir: str | Path, device: torch.device) -> Path:
    """``<cache_dir>/bf16-matmul-<host fingerprint>[-<gpu name>].json``."""
    from hlat.host import host_fingerprint

    suffix = ""
    if device.type == "cuda":
        suffix = "-" + "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device))
    return Path(cache_dir).expanduser() / f"bf16-matmul-{host_fingerprint()}{suffix}.json"


def cached_probe(device: torch.device, cache_dir: str | Path) -> dict[str, float]:
    """This host's probe figures, measured on first use and cached (a corrupt or foreign cache is measured again)."""
    path = _cache_file(cache_dir, device)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        rates = record["gflops"]
        if all(isinstance(rates.get(k), (int, float)) and rates[k] > 0 for k in ("bf16_native", "bf16_emulated")):
            return {k: float(v) for k, v in rates.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    rates = probe(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"gflops": rates, "size": PROBE_SIZE}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)  # atomic: ranks probing at once each write a whole file
    except OSError:
        pass  # an unwritable cache only costs the probe again next time
    return rates


def resolve_policy(requested: str, device: torch.device, cache_dir: str | Path) -> tuple[str, str]:
    """The policy to run (``native`` or ``emulated``) and why, for ``precision.bf16_matmul=requested``.

    ``auto`` takes whichever of the native and the emulated bf16 GEMM the (cached) probe found faster.
    """
    if requested not in POLICIES:
        raise ValueError(f"precision.bf16_matmul={requested!r} is not one of {', '.join(POLICIES)}")
    if requested != "auto":
        return requested, f"precision.bf16_matmul={requested}"
    rates = cached_probe(device, cache_dir)
    native, emulated = rates["bf16_native"], rates["bf16_emulated"]
    policy = "native" if native >= emulated else "emulated"
    return policy, f"auto: bf16 GEMM native {native:.1f} vs emulated {emulated:.1f} GFLOP/s on this host"


def apply_auto_policy(model: nn.Module, device: torch.device) -> str:
    """``apply_policy`` with this host's ``auto`` choice (cache in hlat's default cache directory); returns it."""
    from hlat.host import DEFAULT_CACHE_DIR

    policy = resolve_policy("auto", device, DEFAULT_CACHE_DIR)[0]
    apply_policy(model, policy)
    return policy
