"""How long a checkpoint blocks training: synchronous vs asynchronous saves of hlat's Checkpointer.

    python bench/checkpoint_overhead.py                    # model=small (83M parameters, ~1.35 GB of fp32 state)
    python bench/checkpoint_overhead.py --model tiny --repeats 5

For each mode it builds the model and AdamW (state initialised by one step), then saves ``--repeats`` times and
reports, per save, the seconds the training thread is blocked in ``Checkpointer.save`` and the seconds until the
checkpoint is complete on disk (manifest with sha256 written, directory renamed). For the asynchronous mode it also
times ``--steps`` training steps that run while the save is in flight (so "until complete" is measured while
training goes on) against the same steps without a save, so the cost of the background thread sharing the CPU
shows. The reference is a plain ``torch.save`` of the model and
optimizer state dicts (nanoGPT's way), which blocks for the whole write.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from hlat.backends.torch.backend import TorchBackend
from hlat.checkpoint import Checkpointer
from hlat.config import ModelConfig, OptimizerConfig, RunConfig, TrainConfig
from hlat.optim import param_groups
from hlat.parallel import ParallelDims
from hlat.state import TrainState

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def preset(name: str) -> ModelConfig:
    """A model preset of ``conf/model/``."""
    return ModelConfig(**yaml.safe_load((CONF / f"{name}.yaml").read_text()))


def build(model_cfg: ModelConfig) -> tuple[TorchBackend, torch.nn.Module, torch.optim.Optimizer]:
    """The torch backend's fp32 model and AdamW, as a run builds them."""
    optimizer = OptimizerConfig(warmup_steps=0)  # the schema's AdamW; a run of the default 200 steps warms up less
    backend = TorchBackend(RunConfig(model=model_cfg, optimizer=optimizer, train=TrainConfig(seed=0)))
    backend.setup()
    model = backend.build_model(ParallelDims(1, 1, 1, 1))
    opt = backend.build_optimizer(model, param_groups(model, optimizer))
    return backend, model, opt


def train_steps(backend, model, opt, n: int, batch: torch.Tensor) -> float:
    """Seconds for ``n`` forward/backward/AdamW steps on ``batch``."""
    t0 = time.perf_counter()
    for _ in range(n):
        backend.loss(model, batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "small"), default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="training steps timed while an async save is in flight")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    cfg = preset(args.model)
    backend, model, opt = build(cfg)
    batch = torch.randint(0, cfg.vocab_size, (4, 257))
    train_steps(backend, model, opt, 1, batch)  # AdamW state exists from here on
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model={args.model}: {n_params / 1e6:.1f}M parameters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    base = tempfile.mkdtemp(prefix="hlat-ckpt-bench-", dir=args.dir)

    blocked: dict[str, list[float]] = {}
    durable: dict[str, list[float]] = {}
    for i in range(args.repeats):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(base) / f"plain-{i}.pt")
        blocked.setdefault("torch.save (reference)", []).append(time.perf_counter() - t0)
        durable.setdefault("torch.save (reference)", []).append(time.perf_counter() - t0)
    alone = [train_steps(backend, model, opt, args.steps, batch) for _ in range(args.repeats)]
    during = []
    for mode, async_save in (("hlat sync (DCP + sha256)", False), ("hlat async (DCP async_save)", True)):
        saver = Checkpointer(
            backend,
            Path(base) / mode.split()[1],
            model,
            opt,
            lambda s: {"step": s.step},
            every=0,
            last_step=-1,
            keep_last=1,
            async_save=async_save,
        )
        for i in range(args.repeats):
            t0 = time.perf_counter()
            saver.save(TrainState(step=i + 1))
            blocked.setdefault(mode, []).append(time.perf_counter() - t0)
            if async_save:
                during.append(train_steps(backend, model, opt, args.steps, batch))
            saver.wait()
            durable.setdefault(mode, []).append(saver.last_save_s)
        saver.close()

    print("| save | blocks the training thread (s) | until complete on disk (s) |\n|---|---:|---:|")
    for mode in blocked:
        print(f"| {mode} | {statistics.median(blocked[mode]):.2f} | {statistics.median(durable[mode]):.2f} |")
    a, d = statistics.median(alone), statistics.median(during)
    print(
        f"\n{args.steps} training steps alone: {a:.2f} s; while an async save is in flight: {d:.2f} s "
        f"(+{d - a:.2f} s, the background thread's share of the CPU)"
    )


if __name__ == "__main__":
    main()
