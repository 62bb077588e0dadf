"""The PyTorch backend for CPU and CUDA (single process for now)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from hlat.backends.base import Env
from hlat.config import ClusterConfig, ConfigError, OptimizerConfig, PrecisionConfig
from hlat.parallel import ParallelDims

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TorchBackend:
    """Eager PyTorch: autocast for lower-precision compute, ``torch.optim.AdamW``, host fetch via ``.tolist()``."""

    name = "torch"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.param_dtype = torch.float32
        self.compute_dtype = torch.float32

    def setup(self, cluster: ClusterConfig, precision: PrecisionConfig, seed: int) -> Env:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != 1:
            raise ConfigError(
                f"WORLD_SIZE={world_size}: the torch backend runs a single process in this version; "
                "launch `python train.py` without torchrun"
            )
        if cluster.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("cluster.device=cuda but torch sees no CUDA device; use cluster=cpu")
        self.device = torch.device(cluster.device)
        self.param_dtype = DTYPE[precision.param_dtype]
        self.compute_dtype = DTYPE[precision.compute_dtype]
        if cluster.num_threads is not None:
            torch.set_num_threads(cluster.num_threads)
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = psutil.virtual_memory().available
        return Env(rank=0, world_size=1, device=self.device, memory_budget_bytes=int(free * cluster.memory_fraction))

    def build_model(self, model_fn: Callable[[], nn.Module], dims: ParallelDims) -> nn.Module:
        if dims.tp != 1 or dims.pp != 1:
            raise ConfigError(
                f"parallelism.tp={dims.tp}, parallelism.pp={dims.pp}: the torch backend has no tensor or pipeline "
                "parallelism in this version; use parallelism=single"
            )
        with torch.device("meta"):
            model = model_fn()
        model.to_empty(device=self.device)
        model.init_weights()
        return model.to(self.param_dtype)

    def build_optimizer(self, model: nn.Module, groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        # foreach kernels are the fastest option on CPU and CUDA; fused exists only on CUDA.
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True
        )

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        autocast = self.compute_dtype != self.param_dtype
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            logits = model(inputs)  # (B, T, V)
        # Cross-entropy in fp32: softmax over a 32k vocabulary loses accuracy in bf16 (PAPER.md, "Precision").
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], foreach=True)

    def step_end(self) -> None:
        pass

    def fetch(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, list[float]]], None]) -> None:
        # One device->host copy for everything: flatten and concatenate, a single .tolist() sync, split back.
        names = list(tensors)
        flat = [tensors[k].detach().float().reshape(-1) for k in names]
        values = torch.cat(flat).tolist() if flat else []
        out, i = {}, 0
        for name, t in zip(names, flat, strict=True):
            out[name] = values[i : i + t.numel()]
            i += t.numel()
        fn(out)

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}, path / "state.pt"
        )

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # weights_only: a checkpoint is data; refusing pickled code keeps a shared checkpoint from running it.
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["extra"]
