"""What stochastic rounding costs: step time per precision mode, split into forward+backward and optimizer.

    python bench/precision_overhead.py                     # model=small, 8 x 256 tokens, 3 timed steps per mode
    python bench/precision_overhead.py --model tiny --steps 5

Each mode is built through hlat's torch backend exactly as ``python train.py precision=<mode>`` builds it (same
model init, ``PrecisionAdamW`` / ``torch.optim.AdamW``, fp32 grad accumulation hooks, loss), then trained on one
fixed random batch. Per step it times forward+backward, gradient clipping and ``optimizer.step()`` separately
(wall clock; CPU work is synchronous). Rounds are interleaved across modes so a slow patch hits all of them. The
report is a markdown table to paste into bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hlat.backends.torch.backend import TorchBackend
from hlat.backends.torch.precision import stochastic_round_bf16
from hlat.config import register_configs
from hlat.optim import param_groups
from hlat.parallel import ParallelDims

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf")
MODES = ("fp32", "bf16", "bf16_sr", "master_weights")


def build(mode: str, model: str):
    """Backend, model and optimizer of ``python train.py model=<model> precision=<mode>``."""
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[f"model={model}", f"precision={mode}"]))
    backend = TorchBackend(cfg)
    backend.setup()
    net = backend.build_model(ParallelDims(1, 1, 1, 1))
    opt = backend.build_optimizer(net, param_groups(net, cfg.optimizer))
    return cfg, backend, net, opt


def timed_step(backend, net, opt, inputs, targets) -> tuple[float, float, float]:
    """One training step; seconds spent in forward+backward, clipping and the optimizer."""
    t0 = time.perf_counter()
    backend.loss(net, inputs, targets).backward()
    t1 = time.perf_counter()
    backend.clip_grad_norm(net, 1.0)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    """Run the measurement and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    register_configs()
    built = {m: build(m, args.model) for m in MODES}
    cfg = built["fp32"][0]
    n_params = sum(p.numel() for p in built["fp32"][2].parameters())
    tokens = torch.randint(
        0, cfg.model.vocab_size, (args.micro_batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for m in MODES:  # warm-up: first-step allocations, optimizer state creation
        timed_step(*built[m][1:], inputs, targets)
    for _ in range(args.rounds):
        for m in MODES:
            times[m] += [timed_step(*built[m][1:], inputs, targets) for _ in range(args.steps)]

    # The rounding alone: SR vs round-to-nearest of as many fp32 values as bf16_sr writes (params + 2 moments).
    x = torch.randn(n_params)
    gen = torch.Generator().manual_seed(0)
    rne, sr = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        x.to(torch.bfloat16)
        rne.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        stochastic_round_bf16(x, gen)
        sr.append(time.perf_counter() - t0)

    med = {m: tuple(statistics.median(t[i] for t in times[m]) for i in range(3)) for m in MODES}
    step = {m: sum(med[m]) for m in MODES}
    print(
        f"- model={args.model}: {n_params:,} parameters; micro-batch {args.micro_batch} x {args.seq_len} tokens, "
        f"one micro-batch per step; {args.rounds} rounds x {args.steps} timed steps per mode (medians)"
    )
    cpu = platform.processor() or platform.machine()
    print(f"- machine: {os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| precision | step (s) | forward+backward (s) | clip (s) | optimizer.step (s) | optimizer share of step |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in MODES:
        fb, clip, opt = med[m]
        print(f"| {m} | {step[m]:.3f} | {fb:.3f} | {clip:.3f} | {opt:.3f} | {opt / step[m]:.1%} |")
    extra = med["bf16_sr"][2] - med["bf16"][2]
    print()
    print(
        f"- stochastic rounding's own cost: bf16_sr optimizer.step - bf16 optimizer.step = {extra:.3f} s, "
        f"{extra / step['bf16_sr']:.1%} of the bf16_sr step"
    )
    print(
        f"- rounding {n_params:,} fp32 values once: round-to-nearest {statistics.median(rne) * 1e3:.1f} ms, "
        f"stochastic {statistics.median(sr) * 1e3:.1f} ms (bf16_sr rounds 3x that many per step: params + 2 moments)"
    )


if __name__ == "__main__":
    main()
