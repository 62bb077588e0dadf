"""Which torch engine for data parallelism: DDP (``replicate``), DDP + ZeRO-1, or FSDP2 (``fully_shard``).

    python bench/dp_engines.py                          # model=small, 2 CPU ranks over gloo, fp32
    python bench/dp_engines.py --model tiny --steps 6

The issue asks for DDP "or FSDP2 where it serves better — measure". Each engine trains the same model for
``--steps`` AdamW steps on 2 ranks (the same micro-batches) and reports, per rank: the median step time after
``--warmup`` steps, and the bytes of training state it holds (parameters + gradients + AdamW moments, counting
only this rank's shards) — the memory that data parallelism decides; activations are the same in every engine. The
engines:

- ``ddp``: ``torch.distributed._composable.replicate`` (hlat's choice): whole model and optimizer on every rank,
  gradients all-reduced in buckets during backward.
- ``ddp_zero1``: the same plus ``ZeroRedundancyOptimizer`` (``parallelism.zero1``): AdamW state sharded.
- ``fsdp2``: ``fully_shard`` per block and at the root (torchtitan's layout), parameters resharded after forward
  (ZeRO-3): parameters, gradients and optimizer state sharded; all-gathers in forward and again in backward.
- ``fsdp2_no_reshard``: ``reshard_after_forward=False`` (ZeRO-2): no second all-gather, whole parameters held from
  forward to the end of backward.

Run on one host, so the ranks share its cores (2 here): communication and compute compete for them, as they do
not on GPUs with NCCL. The result is a measurement of this machine, recorded in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from hlat.config import ModelConfig, OptimizerConfig
from hlat.model import Transformer
from hlat.optim import param_groups

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
ENGINES = ("ddp", "ddp_zero1", "fsdp2", "fsdp2_no_reshard")


def preset(name: str) -> ModelConfig:
    """A model preset of ``conf/model/``."""
    return ModelConfig(**yaml.safe_load((CONF / f"{name}.yaml").read_text()))


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def build(engine: str, cfg: ModelConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model parallelized by ``engine`` and its AdamW."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    opt_cfg = OptimizerConfig(lr=1e-4, warmup_steps=0)
    kwargs = {"lr": opt_cfg.lr, "betas": (opt_cfg.beta1, opt_cfg.beta2), "eps": opt_cfg.eps, "foreach": True}
    if engine.startswith("ddp"):
        from torch.distributed._composable.replicate import replicate

        replicate(model)
        groups = param_groups(model, opt_cfg)
        if engine == "ddp_zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
        return model, torch.optim.AdamW(groups, **kwargs)
    from torch.distributed.fsdp import fully_shard

    reshard = engine == "fsdp2"
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(param_groups(model, opt_cfg), **kwargs)


def _worker(rank: int, port: int, engine: str, cfg: ModelConfig, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, opt = build(engine, cfg)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    times, state_bytes = [], 0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        if step == args.warmup + args.steps - 1:  # gradients exist now; optimizer state after the first step
            params = list(model.parameters())
            inner = getattr(opt, "optim", opt)
            moments = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
            state_bytes = sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params)
            state_bytes += sum(local_bytes(t) for t in moments)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    result = {
        "engine": engine,
        "rank": rank,
        "median_step_s": statistics.median(times),
        "state_mib": state_bytes / 2**20,
        "loss": loss.item(),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def free_port() -> int:
    """An unused local TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """Run every engine and print a table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="conf/model preset (default: small)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank (default: 2)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default: 2)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (default: 8)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--json", action="store_true", help="print the per-rank results as JSON lines too")
    args = parser.parse_args()
    cfg = preset(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            out = str(Path(tmp) / engine)
            mp.spawn(_worker, args=(free_port(), engine, cfg, args, out), nprocs=2, join=True)
            rows.append([json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)])
    print(
        f"model={args.model} 2 ranks x {args.batch} x {args.seq_len} tokens, torch {torch.__version__}, "
        f"{os.cpu_count()} cores"
    )
    base = statistics.mean(r["median_step_s"] for r in rows[0])
    print(f"{'engine':<18}{'step s':>9}{'vs ' + rows[0][0]['engine']:>10}{'state MiB/rank':>16}{'loss':>9}")
    for ranks in rows:
        step = statistics.mean(r["median_step_s"] for r in ranks)
        state = max(r["state_mib"] for r in ranks)
        print(f"{ranks[0]['engine']:<18}{step:>9.3f}{step / base:>10.2f}{state:>16.1f}{ranks[0]['loss']:>9.4f}")
        if args.json:
            for r in ranks:
                print(json.dumps(r))


if __name__ == "__main__":
    main()
