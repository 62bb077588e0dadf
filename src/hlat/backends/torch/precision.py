"""Precision modes on the torch backend: stochastic rounding, fp32 gradient accumulation, a low-precision AdamW.

Trainium rounds stochastically in hardware; here the optimizer computes its update in fp32 and writes each bf16
tensor it owns through ``round_to_bf16_`` (to nearest, or stochastically), so the bf16 modes differ only in where
the update lands and how it is rounded (docs/precision.md). May import: ``hlat.config`` and the core.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.optim.adamw import adamw as functional_adamw  # torch.optim deletes the submodule name

from hlat.config import OptimizerConfig, PrecisionConfig
from hlat.norms import grad_of

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOW16 = 0xFFFF
_HIGH16 = -0x10000  # 0xFFFF0000 as int32: keeps sign, exponent and the 7 bf16 mantissa bits


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down with probability proportional to the distance to the two neighbours.

    bf16 is the upper 16 bits of fp32. Adding a uniform random integer in [0, 2^16) to the bit pattern and then
    truncating the lower 16 bits carries into the kept bits with probability (lower bits) / 2^16, which is exactly
    the distance to the lower neighbour over the gap (the same trick as torchao's ``_fp32_to_bf16_sr``). The pattern
    is sign-magnitude, so negative values round in magnitude the same way; a carry out of the mantissa moves to the
    next binade, and inf and the canonical NaN are left unchanged. E[result] == x: the rounding is unbiased.

    Args:
        x: An fp32 tensor.
        generator: Random source on ``x.device``; seed it for reproducible rounding.

    Returns:
        A new bf16 tensor of ``x``'s shape.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    n = x.numel()
    # random_() on int64 yields 63 random bits: two int32 halves per draw, which halves the generator's work.
    bits = torch.empty((n + 1) // 2, dtype=torch.int64, device=x.device).random_(generator=generator)
    bits = bits.view(torch.int32)[:n].view(x.shape)
    bits.bitwise_and_(_LOW16).add_(x.contiguous().view(torch.int32)).bitwise_and_(_HIGH16)
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def round_to_bf16_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``src`` into bf16 ``dst``: stochastically if ``generator`` is given, else round-to-nearest-even.

    Tensor-parallel (DTensor) arguments are rounded shard by shard: both have the parameter's placement, and the
    rounding is elementwise. Replicated ones draw the same bits on every rank (one generator seed), so they stay equal.
    """
    dst, src = _local(dst), _local(src)
    dst.copy_(stochastic_round_bf16(src, generator) if generator is not None else src)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def attach_fp32_grad_accum(model: nn.Module) -> None:
    """Accumulate each low-precision parameter's gradient into an fp32 ``main_grad`` across micro-batches.

    A hook runs as soon as autograd has accumulated a micro-batch's gradient into ``p.grad`` (bf16): it adds it to
    ``p.main_grad`` (fp32) and frees ``p.grad``, so at most one micro-batch gradient per parameter is ever in bf16.
    Megatron and NxD (``use_fp32_grad_acc``) do the same. ``PrecisionAdamW.zero_grad`` clears the buffers.
    """

    def accumulate(p: torch.Tensor) -> None:
        if p.main_grad is None:
            p.main_grad = p.grad.float()
        else:
            p.main_grad.add_(p.grad)
        p.grad = None

    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.main_grad = None
            p.register_post_accumulate_grad_hook(accumulate)


def _chunks(params: list[torch.Tensor], max_numel: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` of at most ``max_numel`` elements (a larger tensor is a run of its own)."""
    run: list[torch.Tensor] = []
    size = 0
    for p in params:
        if run and size + p.numel() > max_numel:
            yield run
            run, size = [], 0
        run.append(p)
        size += p.numel()
    if run:
        yield run


class PrecisionAdamW(torch.optim.Optimizer):
    """AdamW for low-precision parameters: the update is computed in fp32, then written to each storage dtype.

    Per parameter the state holds ``step``, ``exp_avg`` and ``exp_avg_sq`` in ``state_dtype``, and with
    ``master_weights`` an fp32 ``master`` copy. A step upcasts the stored tensors of a chunk of parameters, runs
    PyTorch's own functional AdamW (``torch.optim.adamw.adamw``, fused) on the fp32 copies, and writes back every
    tensor whose storage is bf16 with round-to-nearest-even or, with ``stochastic_rounding``, with
    ``stochastic_round_bf16`` from a generator reseeded from (seed, step), so a resumed run rounds exactly as an
    uninterrupted one. The math is therefore torch's AdamW to the bit; only the storage rounding differs by mode.

    Args:
        params: Parameters or parameter groups (as for ``torch.optim.AdamW``).
        lr: Learning rate.
        betas: (beta1, beta2).
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay.
        master_weights: Keep fp32 master copies (and fp32 moments).
        state_dtype: Storage dtype of the moments when there are no master weights.
        stochastic_rounding: Round bf16 writes stochastically.
        seed: Seed of the rounding (the run's train.seed).
        chunk_numel: Parameters are updated in chunks of about this many elements, which bounds the fp32 copies.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        *,
        master_weights: bool,
        state_dtype: torch.dtype,
        stochastic_rounding: bool,
        seed: int,
        chunk_numel: int = 1 << 25,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.master_weights = master_weights
        self.state_dtype = torch.float32 if master_weights else state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk_numel = chunk_numel
        self._generators: dict[torch.device, torch.Generator] = {}

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            if self.master_weights:
                st["master"] = p.detach().to(torch.float32, copy=True)
        return st

    def _generator(self, device: torch.device, step: int) -> torch.Generator | None:
        if not self.stochastic_rounding:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        # One stream per (seed, step): reproducible and independent of how many steps this process has run.
        gen.manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
        return gen

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One AdamW update of every parameter that has a gradient."""
        if closure is not None:
            raise ValueError("PrecisionAdamW.step takes no closure")
        gens: dict[torch.device, torch.Generator | None] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if grad_of(p) is not None]
            for chunk in _chunks(params, self.chunk_numel):
                states = [self._state(p) for p in chunk]
                device = chunk[0].device
                if device not in gens:
                    gens[device] = self._generator(device, int(states[0]["step"]))
                gen = gens[device]
                # .float() is the tensor itself when it is already fp32: torch's AdamW then updates it in place.
                weights = [
                    st["master"] if self.master_weights else p.float() for p, st in zip(chunk, states, strict=True)
                ]
                m = [st["exp_avg"].float() for st in states]
                v = [st["exp_avg_sq"].float() for st in states]
                functional_adamw(
                    weights,
                    [grad_of(p).float() for p in chunk],
                    m,
                    v,
                    [],
                    [st["step"] for st in states],
                    fused=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                for p, st, w, m32, v32 in zip(chunk, states, weights, m, v, strict=True):
                    if p.dtype != torch.float32:
                        round_to_bf16_(p, w, gen)
                    if self.state_dtype != torch.float32:
                        round_to_bf16_(st["exp_avg"], m32, gen)
                        round_to_bf16_(st["exp_avg_sq"], v32, gen)

    def init_missing_masters(self) -> int:
        """Give each parameter whose state lacks an fp32 master one equal to its bf16 weight; returns how many.

        For a checkpoint written without master weights and resumed with them (``bf16_sr`` -> ``master_weights``,
        as HLAT-70B trains: arXiv 2404.10630 §3.5): the bf16 value is exact in fp32, so the masters start where the
        weights are, and the first update's rounding to nearest writes them back unchanged where nothing moved.
        """
        count = 0
        for group in self.param_groups if self.master_weights else ():
            for p in group["params"]:
                st = self.state.get(p)
                if st and "master" not in st:
                    st["master"] = p.detach().to(torch.float32, copy=True)
                    count += 1
        return count

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` and the fp32 accumulation buffers."""
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore state keeping each saved tensor's dtype.

        ``torch.optim.Optimizer`` casts floating state to its parameter's dtype, which would turn fp32 masters and
        moments of bf16 parameters into bf16.
        """
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step" and torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device, copy=True)


def optimizer_spec(cfg: OptimizerConfig, precision: PrecisionConfig, seed: int) -> tuple[type, dict]:
    """The AdamW class and keyword arguments of a precision mode.

    ``torch.optim.AdamW`` with its fused kernel for fp32 parameters (5-7x faster than the foreach kernels on the
    development CPU: ``bench/adamw_kernels.py``), ``PrecisionAdamW`` for bf16 ones. ZeRO-1 builds one per rank from
    the same spec.
    """
    common = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if precision.param_dtype == "float32":
        return torch.optim.AdamW, common | {"fused": True}
    return PrecisionAdamW, common | {
        "master_weights": precision.master_weights,
        "state_dtype": DTYPE[precision.optimizer_dtype],
        "stochastic_rounding": precision.stochastic_rounding,
        "seed": seed,
    }


def build_optimizer(
    groups: list[dict], cfg: OptimizerConfig, precision: PrecisionConfig, seed: int
) -> torch.optim.Optimizer:
    """The precision mode's AdamW (``optimizer_spec``) over ``groups``."""
    cls, kwargs = optimizer_spec(cfg, precision, seed)
    return cls(groups, **kwargs)
