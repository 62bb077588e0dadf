"""The PyTorch backend for CPU and CUDA (single process for now).

Precision (``hlat.precision``): bf16 parameters are a cast of the fp32 initialization, updated by
``PrecisionAdamW`` (fp32 math, round-to-nearest or stochastic writes, optional fp32 master copy); fp32 parameters
with bf16 compute use autocast; ``fp32_grad_accum`` accumulates bf16 gradients into fp32 buffers;
``fp32_softmax_ce`` runs the cross-entropy on fp32 logits. ``fp32_reduce`` needs no action in a single process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hlat.backends.base import Env
from hlat.config import ClusterConfig, ConfigError, OptimizerConfig, PrecisionConfig
from hlat.parallel import ParallelDims
from hlat.precision import DTYPE, attach_fp32_grad_accum, build_optimizer, global_norm, grad_of


class TorchBackend:
    """Eager PyTorch: bf16 parameters or autocast, AdamW with the precision policy, host fetch via ``.tolist()``."""

    name = "torch"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.precision = PrecisionConfig()
        self.seed = 0

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
        self.precision = precision
        self.seed = seed
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
        model.init_weights()  # in fp32, so every precision mode starts from the same weights (rounded for bf16)
        p = self.precision
        if p.param_dtype != "float32":
            model.to(DTYPE[p.param_dtype])
            model.init_rope()  # .to() cast the rotary tables too; they stay fp32
            if p.fp32_grad_accum:
                attach_fp32_grad_accum(model)
        return model

    def build_optimizer(self, model: nn.Module, groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
        return build_optimizer(groups, cfg, self.precision, self.seed)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        p = self.precision
        autocast = p.param_dtype == "float32" and p.compute_dtype != "float32"
        with torch.autocast(self.device.type, dtype=DTYPE[p.compute_dtype], enabled=autocast):
            logits = model(inputs)  # (B, T, V)
        # fp32 softmax/CE by default: over a 32k vocabulary bf16 loses accuracy (PAPER.md, "Precision").
        logits = logits.float() if p.fp32_softmax_ce else logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).float()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        grads = [g for g in map(grad_of, model.parameters()) if g is not None]
        norm = global_norm(grads)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # no host sync: multiply by 1 when under the limit
            for g in grads:
                g.mul_(coef)
        return norm

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

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *,
             async_save: bool) -> Future | None:  # fmt: skip
        # extra (train state, loader position, RNG) is small: written now. Weights and optimizer state go through
        # torch.distributed.checkpoint, which shards them by rank and, asynchronously, stages a host copy first.
        torch.save(extra, path / EXTRA)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        _quiet_single_process_dcp()
        if async_save:
            return dcp.async_save(state, checkpoint_id=path, no_dist=not _distributed())
        dcp.save(state, checkpoint_id=path, no_dist=not _distributed())
        return None

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout to load into (fills empty AdamW state)
        state = {"model": model_sd, "optimizer": optim_sd}
        _quiet_single_process_dcp()
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        # weights_only: a checkpoint is data; refusing pickled code keeps a shared checkpoint from running it.
        return torch.load(path / EXTRA, map_location="cpu", weights_only=True)


EXTRA = "extra.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _quiet_single_process_dcp() -> None:
    """DCP warns on every save and load that it assumes a single process when there is no process group: we know.

    A filter, not a ``catch_warnings`` block: the asynchronous writer thread warns too, out of such a block's reach.
    """
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable", category=UserWarning)
