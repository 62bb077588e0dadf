"""AdamW kernels: what one optimizer step costs with torch's foreach and fused kernels, per precision mode.

    python bench/adamw_kernels.py                  # model=small's parameters (83.4M), 6 timed steps, 2 rounds
    python bench/adamw_kernels.py --model tiny

hlat's fp32 mode steps ``torch.optim.AdamW`` and its bf16 modes step ``hlat.backends.torch.precision.PrecisionAdamW``,
which runs torch's functional AdamW on fp32 copies and rounds them back to bf16. Each row builds the model's parameters
with a random gradient and times ``optimizer.step()`` alone (median of the timed steps; rounds interleaved, median over
rounds). "foreach" and "fused" are the ``torch.optim.adamw.adamw`` implementations; hlat uses fused since this benchmark
(``hlat.backends.torch.precision.optimizer_spec``).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator

import torch

import hlat.backends.torch.precision as precision
from hlat.backends.torch.precision import PrecisionAdamW
from hlat.config import ModelConfig
from hlat.host import host_info
from hlat.model import Transformer

KW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SHAPES = {
    "small": ModelConfig(name="small", dim=768, n_layers=10, n_heads=12, ffn_dim=2048, vocab_size=8192),
    "tiny": ModelConfig(name="tiny", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=4096),
}


def parameters(cfg: ModelConfig, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The model's parameters in ``dtype``, each with a random gradient."""
    params = list(Transformer(cfg).to(dtype).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@contextlib.contextmanager
def functional_impl(kind: str) -> Iterator[None]:
    """Make ``PrecisionAdamW`` call torch's functional AdamW with the ``kind`` implementation inside the block."""
    real = precision.functional_adamw

    def call(*args, fused=None, foreach=None, **kwargs):
        return real(*args, **({"fused": True} if kind == "fused" else {"foreach": True}), **kwargs)

    precision.functional_adamw = call
    try:
        yield
    finally:
        precision.functional_adamw = real


def time_steps(opt: torch.optim.Optimizer, steps: int) -> float:
    """Median milliseconds of ``opt.step()`` after one untimed step."""
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def contenders(cfg: ModelConfig) -> dict[str, tuple[str | None, Callable[[], torch.optim.Optimizer]]]:
    """Row label -> (the functional AdamW kind to patch into PrecisionAdamW or None, a builder over fresh params)."""
    rows: dict[str, tuple[str | None, Callable[[], torch.optim.Optimizer]]] = {}
    for kind in ("foreach", "fused"):
        rows[f"fp32: torch.optim.AdamW, {kind}"] = (
            None,
            lambda k=kind: torch.optim.AdamW(parameters(cfg, torch.float32), **KW, **{k: True}),
        )
    bf16 = {"master_weights": False, "state_dtype": torch.bfloat16, "seed": 0}
    for sr in (False, True):
        for kind in ("foreach", "fused"):
            label = f"bf16{' + SR' if sr else ''}: PrecisionAdamW, {kind}"
            rows[label] = (
                kind,
                lambda s=sr: PrecisionAdamW(parameters(cfg, torch.bfloat16), **KW, **bf16, stochastic_rounding=s),
            )
    return rows


def main() -> None:
    """Time every row, interleaved over rounds, and print the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cfg = SHAPES[args.model]
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for label, (kind, build) in contenders(cfg).items():
            with functional_impl(kind) if kind else contextlib.nullcontext():
                results.setdefault(label, []).append(time_steps(build(), args.steps))
    n = sum(p.numel() for p in Transformer(cfg).parameters())
    print(
        f"`python bench/adamw_kernels.py --model {args.model}`: {n / 1e6:.1f}M parameters, {host_info()}, "
        f"{platform.platform()}, torch {torch.__version__}\n"
    )
    print("| optimizer | ms per step (median) |\n|---|---:|")
    for label, ms in results.items():
        print(f"| {label} | {statistics.median(ms):.0f} |")


if __name__ == "__main__":
    main()
