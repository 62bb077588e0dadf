"""The PyTorch backend for CPU and CUDA: one process, or many under torchrun (DDP, ZeRO-1, TP, FSDP2).

Precision (``precision``): bf16 parameters are a cast of the fp32 initialization, updated by
``PrecisionAdamW`` (fp32 math, round-to-nearest or stochastic writes, optional fp32 master copy); fp32 parameters
with bf16 compute use autocast; ``fp32_grad_accum`` accumulates bf16 gradients into fp32 buffers;
``fp32_softmax_ce`` runs the cross-entropy on fp32 logits. ``fp32_reduce`` needs no action in a single process.
"""

from __future__ import annotations

import functools
import logging
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

from hlat import layouts, safe_load
from hlat.backends.base import EXTRA, Env, read_extra
from hlat.backends.torch import reshard
from hlat.backends.torch.bf16_matmul import apply_policy
from hlat.backends.torch.dist import (
    Ranks,
    average_over_ranks,
    broadcast_parameters,
    data_parallel,
    device_mesh,
    fully_shard_dp,
    init_process_group,
    mean_over_ranks,
    settle_buckets,
    tensor_parallel,
)
from hlat.backends.torch.precision import (
    DTYPE,
    PrecisionAdamW,
    attach_fp32_grad_accum,
    build_optimizer,
    optimizer_spec,
)
from hlat.backends.torch.recompute import apply_activation_checkpointing
from hlat.config import ConfigError, RunConfig
from hlat.model import Transformer
from hlat.norms import global_norm, grad_of
from hlat.parallel import ParallelDims
from hlat.plan.bf16_policy import resolve_policy
from hlat.state import NULL_TIMER
from hlat.tally import Batch, mixture_of

log = logging.getLogger(__name__)


class TorchBackend:
    """Eager PyTorch: bf16 parameters or autocast, AdamW with the precision policy, host fetch via ``.tolist()``."""

    name = "torch"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.compile = cfg.train.compile
        """``train.compile``: ``build_model`` compiles each transformer block."""
        self.precision, self.seed = cfg.precision, cfg.train.seed
        self.device = torch.device("cpu")
        self.ranks = Ranks(0, 1, 0, 1)
        self.ckpt_group: dist.ProcessGroup | None = None
        self.zero1 = False
        self.tp = 1
        """The TP degree of the model ``build_model`` built (a checkpoint of another degree is resharded on load)."""
        self.fp32_accum = self.fp32_dp = False
        self.bf16_matmul = "native"
        """The resolved ``precision.bf16_matmul`` policy that ``build_model`` applies."""

    def setup(self) -> Env:
        cluster, precision, seed = self.cfg.cluster, self.precision, self.seed
        ranks = Ranks.from_env()
        if cluster.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("cluster.device=cuda but torch sees no CUDA device; use cluster=cpu")
        self.device = torch.device("cuda", ranks.local_rank) if cluster.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ranks = ranks
        threads = cluster.num_threads
        if threads is None and self.device.type == "cpu" and ranks.local_world_size > 1:
            threads = max(1, (os.cpu_count() or 1) // ranks.local_world_size)  # processes share the cores
        if threads is not None:
            torch.set_num_threads(threads)
        self.ckpt_group = init_process_group(ranks, self.device, self.cfg.health.collective_timeout_s)
        torch.manual_seed(seed)  # the same on every rank: replicas start from the same weights
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:  # the ranks on this host share its memory
            free = psutil.virtual_memory().available // ranks.local_world_size
        policy, why = None, ""
        if precision.compute_dtype == "bfloat16":
            policy, why = resolve_policy(precision.bf16_matmul, self.device, self.cfg.data.cache_dir)
            self.bf16_matmul = policy
        return Env(
            rank=ranks.rank,
            world_size=ranks.world_size,
            device=self.device,
            memory_budget_bytes=int(free * cluster.memory_fraction),
            bf16_matmul=policy,
            bf16_matmul_reason=why,
        )

    def build_model(self, dims: ParallelDims, init_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        par = self.cfg.parallelism
        with torch.device("meta"):
            model = Transformer(self.cfg.model)
        layouts.check_torch_layout(dims, model.cfg, self.precision)  # before anything is materialized
        model.to_empty(device=self.device)
        model.init_weights(self.seed)  # fp32, keyed by seed and name: every precision and layout starts alike
        if init_state is not None:  # train.init_from: before the dtype cast and the TP split (gate_up reordering)
            model.load_state_dict(init_state)
        p = self.precision
        if p.param_dtype != "float32":
            model.to(DTYPE[p.param_dtype])
            model.init_rope()  # .to() cast the rotary tables too; they stay fp32
        fp32_accum = p.param_dtype != "float32" and p.fp32_grad_accum
        # fp32 accumulation under DP: no DDP (it reduces the bf16 .grad of every micro-batch); each rank accumulates
        # its micro-batches into fp32 main_grad and forward_backward averages those once per step (Megatron's way).
        self.fp32_accum, self.fp32_dp = fp32_accum, fp32_accum and dims.dp > 1
        self.tp = dims.tp
        self.zero1 = par.zero1 and dims.dp > 1 and dims.tp == 1  # with TP, FSDP2 shards the AdamW state anyway
        if p.compute_dtype == "bfloat16":  # the functions the linears and cores call; names unchanged
            apply_policy(model, self.bf16_matmul)
        apply_activation_checkpointing(model, par.activation_checkpointing)  # names unchanged: before TP and DP
        mesh = device_mesh(self.device, dims.dp, dims.tp) if dims.tp > 1 else None
        if mesh is not None:
            tensor_parallel(model, mesh["tp"], par.sequence_parallel, fp32_reduce=p.fp32_reduce)
        if self.compile:  # torchtitan's order: after activation checkpointing and TP, before FSDP / DDP
            compile_blocks(model)
        if mesh is not None and dims.dp > 1:  # DDP takes no DTensor parameters: FSDP2 over dp (torchtitan's 2-D)
            fully_shard_dp(model, mesh["dp"], fp32_reduce=p.fp32_reduce)
        elif self.fp32_dp:
            broadcast_parameters(model)
        elif dims.dp > 1:
            data_parallel(model, self.device, fp32_reduce=p.fp32_reduce)
            settle_buckets(model, self.device)  # a resume then reduces as the uninterrupted run does, bit for bit
        if fp32_accum:  # after TP, which replaces the parameters (and would drop their hooks) with DTensor ones
            attach_fp32_grad_accum(model)
        return model

    def build_optimizer(self, model: nn.Module, groups: list[dict]) -> torch.optim.Optimizer:
        cfg = self.cfg.optimizer
        groups = _split_dtensor_groups(groups)
        if not self.zero1:
            return build_optimizer(groups, cfg, self.precision, self.seed)
        # ZeRO-1: each data-parallel rank keeps the AdamW state of its share of the parameters only.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        inner, kwargs = optimizer_spec(cfg, self.precision, self.seed)
        return ZeroRedundancyOptimizer(groups, optimizer_class=inner, **kwargs)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, targets = self._logits(model, inputs, targets)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).float()

    def _logits(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forward under the precision policy: the logits the loss is taken on (B, T, V), and the targets."""
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        p = self.precision
        autocast = p.param_dtype == "float32" and p.compute_dtype != "float32"
        with torch.autocast(self.device.type, dtype=DTYPE[p.compute_dtype], enabled=autocast):
            logits = model(inputs)  # (B, T, V)
        # fp32 softmax/CE by default: over a 32k vocabulary bf16 loses accuracy (HLAT slides p.37).
        return (logits.float() if p.fp32_softmax_ce else logits), targets

    def _tallied_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """A mixture's micro-batch: the mean token loss, its per-token losses added to the per-source tally."""
        logits, targets = self._logits(model, *batch)
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").float()
        batch.tally.add(per_token.view(targets.shape), batch.sources)
        return per_token.mean()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        grads = [g for g in map(grad_of, model.parameters()) if g is not None]
        norm = global_norm(grads)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # no host sync: multiply by 1 when under the limit
            for g in grads:
                g.mul_(coef)
        return norm

    def param_norm(self, model: nn.Module) -> torch.Tensor:
        return global_norm([p.detach() for p in model.parameters()])

    def step_end(self) -> None:
        pass

    def host_metrics(self) -> dict[str, float]:
        return {}

    def graph_ledger(self) -> None:
        return None  # eager PyTorch: no graphs to compile (torch.compile's are its own, not a platform's)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fetch(self, tensors: dict[str, torch.Tensor], fn: Callable[[dict[str, list[float]]], None]) -> None:
        # One device->host copy for everything: flatten and concatenate, a single .tolist() sync, split back.
        # Averaged over the ranks (the loss over data-parallel ranks; norms are the same on every replica).
        names = list(tensors)
        flat = [tensors[k].detach().float().reshape(-1) for k in names]
        values = mean_over_ranks(torch.cat(flat)).tolist() if flat else []
        out, i = {}, 0
        for name, t in zip(names, flat, strict=True):
            out[name] = values[i : i + t.numel()]
            i += t.numel()
        fn(out)

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, async_save: bool
    ) -> Future | None:
        if self.ckpt_group is not None:
            dist.barrier(group=self.ckpt_group)  # rank 0 has (re)created the directory: now every rank writes into it
        # extra (train state, this rank's loader position, RNG) is small: written now, one file per rank. Weights and
        # optimizer state go through torch.distributed.checkpoint, which writes each replicated tensor once and,
        # asynchronously, stages a host copy first.
        torch.save(extra, path / EXTRA.format(rank=self.ranks.rank))
        state = {"model": model.state_dict(), "optimizer": self._optim_state(model, optimizer)}
        _quiet_single_process_dcp()
        kw = {"checkpoint_id": path, "process_group": self.ckpt_group, "no_dist": self.ckpt_group is None}
        if async_save:
            return dcp.async_save(state, **kw)
        dcp.save(state, **kw)
        return None

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The layout to load into; for AdamW, get_state_dict fills the still-empty state with a zero-lr step.
        state = {"model": model.state_dict(), "optimizer": self._optim_state(model, optimizer)}
        _quiet_single_process_dcp()
        # Not dcp.load: DCP's own reader unpickles .metadata, and non-tensor items, unrestricted (hlat.safe_load).
        load = functools.partial(
            safe_load.load, path=path, process_group=self.ckpt_group, no_dist=self.ckpt_group is None
        )
        no_master = reshard.load_state(state, path, self.tp, load)  # from whatever TP / DP / ZeRO-1 layout saved it
        inner = _inner(optimizer)
        set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if no_master and isinstance(inner, PrecisionAdamW):  # a bf16_sr checkpoint resumed with master_weights
            inner.init_missing_masters()
            if self.ranks.rank == 0:
                log.info(
                    "%s has no fp32 master weights (precision.master_weights=false when it was written): they start "
                    "as its bf16 weights, exactly, and its bf16 AdamW moments continue in fp32",
                    path,
                )
        return read_extra(path, self.ranks.rank)  # rank 0's for a rank the saving run had not

    @staticmethod
    def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """AdamW state keyed by parameter name; under ZeRO-1 only this rank's share, under names no other rank has."""
        return get_state_dict(model, _inner(optimizer))[1]

    def forward_backward(self, model: nn.Module, batches: Any, n: int) -> torch.Tensor:
        if self.fp32_accum:  # a fresh fp32 sum per step (ZeRO-1's zero_grad clears only .grad, not every main_grad)
            for q in model.parameters():
                q.main_grad = None
        timer = getattr(batches, "timer", NULL_TIMER)  # hlat.train.loop.MicroBatches carries the step's phase timer
        total: torch.Tensor | None = None
        for batch in batches:  # (inputs, targets) pairs, drawn one micro-batch at a time
            with timer.phase("forward"):
                mixture = mixture_of(batch)  # a mixture's: per-source losses too (hlat.tally)
                loss = (self.loss(model, *batch) if mixture is None else self._tallied_loss(model, mixture)) / n
            with timer.phase("backward"):
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None, "a step has at least one micro-batch"
        if self.fp32_dp:
            with timer.phase("backward"):  # the gradient all-reduce DDP would have overlapped with backward
                average_over_ranks([q.main_grad for q in model.parameters() if q.main_grad is not None])
        return total

    def update(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, bool]:
        norm = self.clip_grad_norm(model, self.cfg.optimizer.clip_grad_norm)
        skip_nonfinite = self.cfg.train.on_nonfinite == "skip_step"
        if skip_nonfinite and not bool(torch.isfinite(norm)):  # the loop's only per-step host read
            return norm, False
        optimizer.step()
        return norm, True


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` the forward of each transformer block in place, as torchtitan compiles per block.

    The block's ``forward`` is replaced by its compiled version on the instance, so no ``OptimizedModule`` wraps
    it: parameter and buffer names (checkpoints, per-layer metrics) stay as they are. Module hooks stay outside
    the graph and eager, as with torchtitan's wrapper: FSDP2's all-gather hooks added later on the block. Each block
    is one graph (``fullgraph``: a graph break is an error, not a silent slowdown) with static shapes: training
    feeds one shape. Dynamo treats the block's parameters as graph inputs, so every block reuses the first block's
    compiled code and the compile cost is paid once per model. Embedding, final norm, head and loss stay eager.
    """
    for block in model.layers:
        block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)


def _split_dtensor_groups(groups: list[dict]) -> list[dict]:
    """Each parameter group split into its DTensor and its plain parameters (same options).

    Tensor parallelism without sequence parallelism leaves the norms plain tensors beside DTensor weights, and the
    foreach AdamW kernels refuse a list mixing the two ("got mixed torch.Tensor and DTensor").
    """
    from torch.distributed.tensor import DTensor

    out = []
    for g in groups:
        params = list(g["params"])
        for kind in (True, False):
            part = [p for p in params if isinstance(p, DTensor) is kind]
            if part:
                out.append({**g, "params": part})
    return out


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds state: ZeRO-1's local AdamW over this rank's parameters, or the optimizer itself."""
    return getattr(optimizer, "optim", optimizer)


def _quiet_single_process_dcp() -> None:
    """DCP warns on every save and load that it assumes a single process when there is no process group: we know.

    A filter, not a ``catch_warnings`` block: the asynchronous writer thread warns too, out of such a block's reach.
    """
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable", category=UserWarning)
