"""bf16 training steps with native and emulated bf16 matmuls, side by side with fp32, on this host.

    python bench/bf16_matmul.py                      # model=small, 2 x 256 tokens a step (~8 min on an AVX2 CPU)
    python bench/bf16_matmul.py --native-steps 0     # without the native bf16 row (it is ~100x slower on AVX2)
    python bench/bf16_matmul.py --model tiny --steps 5

Every row is built through hlat's torch backend exactly as ``python train.py model=<model> precision=<mode>
precision.bf16_matmul=<policy>`` builds it (``TorchBackend.setup``, ``build_model``, ``build_optimizer``) and
trained on one fixed random batch: forward, loss, backward, gradient clipping, ``optimizer.step()``, ``zero_grad``.
The fp32 and emulated rows run in interleaved rounds after a warm-up step, so a slow patch of the machine hits all
of them; the native row runs its steps once at the end, without a warm-up (one step takes minutes where the CPU has
no bf16 instructions, and the first step's extra cost is small against that). The report prints the host's CPU
capability and the policy probe's figures, then a markdown table to paste into bench/README.md.
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
from hlat.config import register_configs
from hlat.host import DEFAULT_CACHE_DIR
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from hlat.plan.bf16_policy import probe, resolve_policy

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf")
EMULATED = (("fp32", "native"), ("bf16", "emulated"), ("bf16_sr", "emulated"), ("master_weights", "emulated"))
NATIVE = ("bf16_sr", "native")


def build(model: str, mode: str, policy: str):
    """Backend, model and optimizer of ``python train.py model=<model> precision=<mode>`` under ``policy``."""
    overrides = [f"model={model}", f"precision={mode}", f"precision.bf16_matmul={policy}"]
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    backend = TorchBackend(cfg)
    env = backend.setup()
    assert env.bf16_matmul in (None, policy), (env.bf16_matmul, policy)
    net = backend.build_model(ParallelDims(1, 1, 1, 1))
    opt = backend.build_optimizer(net, param_groups(net, cfg.optimizer))
    return backend, net, opt


def timed_step(backend, net, opt, inputs, targets) -> tuple[float, float, float]:
    """One training step: seconds of forward+backward, of clip+optimizer, and the loss."""
    t0 = time.perf_counter()
    loss = backend.loss(net, inputs, targets)
    loss.backward()
    t1 = time.perf_counter()
    backend.clip_grad_norm(net, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1, float(loss.detach())


def main() -> None:
    """Run the measurement and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row and round (fp32 and emulated)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--native-steps", type=int, default=1, help="timed native bf16 steps (0: no native row)")
    args = ap.parse_args()
    register_configs()
    rates = probe()
    auto, why = resolve_policy("auto", torch.device("cpu"), DEFAULT_CACHE_DIR)
    rows = list(EMULATED) + ([NATIVE] if args.native_steps else [])
    built = {row: build(args.model, *row) for row in rows}
    n_params = sum(p.numel() for p in built[EMULATED[0]][1].parameters())
    vocab = built[EMULATED[0]][1].cfg.vocab_size
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times: dict[tuple[str, str], list[tuple[float, float, float]]] = {row: [] for row in rows}
    first = {row: timed_step(*built[row], inputs, targets)[2] for row in EMULATED}  # warm-up: state creation
    started = time.time()
    for _ in range(args.rounds):
        for row in EMULATED:
            times[row] += [timed_step(*built[row], inputs, targets) for _ in range(args.steps)]
    if args.native_steps:
        times[NATIVE] = [timed_step(*built[NATIVE], inputs, targets) for _ in range(args.native_steps)]
        first[NATIVE] = times[NATIVE][0][2]

    step = {row: statistics.median(fb + upd for fb, upd, _ in times[row]) for row in rows}
    fp32 = step[EMULATED[0]]
    n_tok = args.micro_batch * args.seq_len
    print(
        f"- host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"- policy probe (512x512 GEMM, GFLOP/s): fp32 {rates['float32']:.1f}, bf16 native "
        f"{rates['bf16_native']:.2f}, bf16 emulated {rates['bf16_emulated']:.1f}; auto picks **{auto}** ({why})"
    )
    print(
        f"- model={args.model}: {n_params:,} parameters; {args.micro_batch} x {args.seq_len} = {n_tok} tokens a "
        f"step; {args.rounds} rounds x {args.steps} timed steps per row (median), native: {args.native_steps} "
        f"step(s); timed part took {time.time() - started:.0f} s"
    )
    print()
    print(
        "| precision | bf16 matmuls | s/step | forward+backward (s) | clip+AdamW (s) | tokens/s | step rate vs fp32 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        fb = statistics.median(t[0] for t in times[row])
        upd = statistics.median(t[1] for t in times[row])
        policy = row[1] if row[0] != "fp32" else "-"
        print(
            f"| {row[0]} | {policy} | {step[row]:.3f} | {fb:.3f} | {upd:.3f} | {n_tok / step[row]:,.0f} | "
            f"{fp32 / step[row]:.2f}x |"
        )
    print(
        "\n- first-step loss (same weights, same batch): "
        + ", ".join(f"{m}/{p} {v:.4f}" for (m, p), v in first.items())
    )


if __name__ == "__main__":
    main()
