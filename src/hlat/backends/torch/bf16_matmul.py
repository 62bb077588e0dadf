"""bf16 matmuls on the torch backend, natively or emulated in fp32 where the host has no fast bf16 kernel.

Emulated, the model's ``Linear`` layers and attention cores multiply bf16 tensors by upcasting them to fp32,
summing in fp32 and rounding the result once to bf16, forward and backward, as bf16 hardware does; saved tensors
stay bf16. ``apply_policy`` sets the functions they call (``Linear.linear``, ``AttentionCore.sdpa``);
``hlat.plan.bf16_policy`` decides which policy is faster here (docs/precision.md). May import: the core, the planner.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hlat.host import DEFAULT_CACHE_DIR
from hlat.model import AttentionCore, Linear
from hlat.plan.bf16_policy import resolve_policy

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


def apply_policy(model: nn.Module, policy: str) -> int:
    """Make ``model``'s bf16 matmuls follow ``policy`` (``native``: nothing to do; ``emulated``), in place.

    Each ``hlat.model.Linear`` multiplies through ``emulated_linear`` and each ``AttentionCore`` attends through
    ``emulated_sdpa``: no name, parameter or hook changes. Call before compilation.

    Returns:
        The number of modules changed.
    """
    if policy not in ("native", "emulated"):
        raise ValueError(f"apply_policy takes a resolved policy, 'native' or 'emulated', not {policy!r}")
    if policy == "native":
        return 0
    changed = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.linear = emulated_linear
            changed += 1
        elif isinstance(module, AttentionCore):
            module.sdpa = emulated_sdpa
            changed += 1
    return changed


def apply_auto_policy(model: nn.Module, device: torch.device) -> str:
    """``apply_policy`` with this host's ``auto`` choice (cache in hlat's default cache directory); returns it."""
    policy = resolve_policy("auto", device, DEFAULT_CACHE_DIR)[0]
    apply_policy(model, policy)
    return policy
