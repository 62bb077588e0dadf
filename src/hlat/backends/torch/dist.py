"""torch.distributed pieces of the torch backend: the process group, data parallelism, gradient reduction dtype.

Everything here is torch's own engine: ``init_process_group`` (gloo on CPU, NCCL plus gloo on CUDA, so that
checkpoint I/O can run on a CPU group), DDP in its composable form (``replicate``: the module keeps its class
and parameter names, so checkpoints, metrics and hooks see the same model as in one process) and a DDP
communication hook for fp32 reduction of low-precision gradients.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, from the variables torchrun / torch elastic set."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls) -> Ranks:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (a lone process: rank 0 of 1)."""
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            int(env.get("RANK", "0")),
            world,
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("LOCAL_WORLD_SIZE", str(world))),
        )


def init_process_group(ranks: Ranks, device: torch.device, timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """Join the job's default process group (env:// rendezvous); returns a gloo group for checkpoint I/O.

    Asynchronous checkpoints run collectives from a background thread, so they get a group of their own: two
    threads interleaving collectives on one group would deadlock or mix up their messages.

    Args:
        ranks: This process's place in the job.
        device: cpu (gloo) or cuda (NCCL, plus gloo for CPU tensors).
        timeout_s: Seconds a collective of either group may wait before it raises (``health.collective_timeout_s``;
            NCCL's watchdog then aborts the process); None: torch's default (30 minutes for gloo).
    """
    if ranks.world_size == 1:
        return None
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if not dist.is_initialized():
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
            store=_attempt_store(ranks, timeout),
            rank=ranks.rank,
            world_size=ranks.world_size,
            device_id=device if device.type == "cuda" else None,
            timeout=timeout,
        )
    return dist.new_group(backend="gloo", timeout=timeout)


def _attempt_store(ranks: Ranks, timeout: datetime.timedelta | None) -> dist.Store:
    """The rendezvous store, with keys private to this attempt of the job.

    Under torch elastic the store lives in the agent and outlives the workers; with the plain ``env://`` init a
    restarted group found the previous attempt's gloo addresses there and failed to connect ("connectFullMesh
    failed ... Connection refused", torch 2.13; pytorch/pytorch#167288 reports the same with NCCL). A prefix per
    attempt keeps each attempt's keys apart. The attempt is the one every rank agrees on (:mod:`hlat.launch.attempt`),
    not ``TORCHELASTIC_RESTART_COUNT``: that count is per agent, so after one node's worker died the nodes waited
    under different prefixes and the job hung.
    """
    from hlat.launch import attempt

    env = os.environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it, as env:// does
    extra = {"timeout": timeout} if timeout is not None else {}
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        ranks.world_size,
        is_master=ranks.rank == 0 and not agent_store,
        wait_for_workers=False,
        **extra,
    )
    number = attempt.current(store, timeout.total_seconds() if timeout is not None else None)
    return dist.PrefixStore(f"hlat/attempt_{number}", store)


def _fp32_allreduce(state, bucket):
    """DDP communication hook: average a bucket of low-precision gradients in fp32, then write them back.

    Unannotated on purpose: DDP checks the annotations and rejects the strings ``from __future__ import
    annotations`` makes of them. ``bucket`` is a ``dist.GradBucket``; returns a future of its tensor.
    """
    buf = bucket.buffer()
    full = buf.to(torch.float32).div_(dist.get_world_size())
    fut = dist.all_reduce(full, async_op=True).get_future()

    def back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def data_parallel(model: nn.Module, device: torch.device, *, fp32_reduce: bool) -> nn.Module:
    """Replicate ``model`` over the data-parallel ranks (DDP: gradients averaged in buckets during backward).

    Before training, a model of tokens gets :func:`settle_buckets`, so that every start reduces in the same bucket
    layout.
    """
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_ids=[device.index] if device.type == "cuda" else None)
    low = any(p.dtype != torch.float32 for p in model.parameters())
    if fp32_reduce and low:
        model.register_comm_hook(None, _fp32_allreduce)
    return model


def settle_buckets(model: nn.Module, device: torch.device) -> None:
    """One throwaway forward and backward of one token through DDP-wrapped ``model``, so its buckets settle now.

    DDP rebuilds its buckets once, after its first iteration, in the order the gradients became ready. A ring
    all-reduce over three or more ranks sums each element in an order set by its place in the bucket, so without
    this the first step of every (re)start would reduce in the initial layout and every later step in the rebuilt
    one: a resumed run's first step would differ from the uninterrupted run's by fp32 rounding. After this, every
    training step of every start runs in the rebuilt layout. The gradients are discarded; no parameter, optimizer
    or RNG state changes, and compiled blocks run eagerly here (no compile for the throwaway shape).
    """
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.compiler.set_stance("force_eager"):
        model(tokens).float().sum().backward()
    model.zero_grad(set_to_none=True)


def device_mesh(device: torch.device, dp: int, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh of the job, tensor parallelism innermost: rank = dp_rank * tp + tp_rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def fully_shard_dp(model: nn.Module, mesh: DeviceMesh, *, fp32_reduce: bool) -> nn.Module:
    """Data parallelism over the 1-D ``mesh`` for a tensor-parallel model: FSDP2 (``fully_shard``).

    DDP does not take DTensor parameters of a 2-D mesh; FSDP2 does (torchtitan's TP + FSDP layout). Each block is
    its own unit, parameters stay gathered from forward to backward (``reshard_after_forward=False``, ZeRO-2:
    gradients and AdamW state sharded over dp, no second all-gather), and gradients are reduce-scattered in fp32
    when ``fp32_reduce`` and the weights are bf16.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = any(p.dtype != torch.float32 for p in model.parameters())
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32 if fp32_reduce and low else None)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def broadcast_parameters(model: nn.Module) -> None:
    """Give every rank rank 0's weights (as DDP does when it wraps a model)."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)


def average_over_ranks(tensors: list[torch.Tensor], bucket_numel: int = 1 << 24) -> None:
    """Average ``tensors`` in place over all ranks, a flat bucket of up to ``bucket_numel`` elements per all-reduce."""
    world = dist.get_world_size()
    bucket: list[torch.Tensor] = []
    numel = 0
    for i, t in enumerate(tensors):
        bucket.append(t)
        numel += t.numel()
        if numel >= bucket_numel or i == len(tensors) - 1:
            flat = torch.cat([b.reshape(-1) for b in bucket]).div_(world)
            dist.all_reduce(flat)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, numel = [], 0


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over all ranks (SUM then divide: gloo has no AVG); ``t`` itself outside a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t.div_(dist.get_world_size())


def _interleave_gate_up(weight: torch.Tensor, tp: int) -> None:
    """Reorder the fused [gate; up] rows to [gate_0; up_0; gate_1; up_1; ...].

    A contiguous split over ``tp`` ranks then hands each one matching gate and up rows, so the model's
    ``chunk(2)`` works per rank.
    """
    with torch.no_grad():
        weight.copy_(gate_up_interleaved(weight, tp))


def gate_up_interleaved(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows [gate; up] as ``tp`` ranks hold them, [gate_0; up_0; gate_1; up_1; ...] (a new tensor)."""
    gate, up = weight.chunk(2)
    return torch.cat([t for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True) for t in pair])


def _fp32_rowwise(**kwargs):
    """``RowwiseParallel`` whose partial sums are all-reduced (or reduce-scattered) in fp32, then cast back.

    A class made on first use: ``torch.distributed.tensor.parallel`` is imported lazily in this module.
    """
    from torch.distributed.tensor.parallel import RowwiseParallel

    class Fp32ReduceRowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            dtype = outputs.dtype
            if outputs.placements != output_layouts:  # a cast is linear: the fp32 copy is still a Partial sum
                outputs = outputs.to(torch.float32).redistribute(placements=output_layouts).to(dtype)
            return outputs.to_local() if use_local_output else outputs

    return Fp32ReduceRowwise(**kwargs)


def gate_up_in_model_order(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of ``_interleave_gate_up``: rows [gate_0; up_0; gate_1; up_1; ...] back to [gate; up].

    Returns a new tensor; for a tensor-parallel run's saved or gathered gate_up weight or gradient.
    """
    parts = weight.chunk(2 * tp)
    return torch.cat([*parts[0::2], *parts[1::2]])


def tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, *, fp32_reduce: bool = False
) -> nn.Module:
    """Shard ``model`` over the 1-D ``mesh`` with DTensor (``parallelize_module``) as ``hlat.parallel.TP_PLAN`` says.

    The model must be materialized with the same weights on every rank (same seed); each rank keeps its shard.
    With ``sequence_parallel`` the norms and the residual stream are split along the sequence (Shard(1)), the
    inputs of attention and MLP are all-gathered, and their outputs reduce-scattered (torchtitan's layout).
    With ``fp32_reduce`` and low-precision weights the rowwise layers' partial sums are reduced in fp32
    (``precision.fp32_reduce``; as the ``reduce_dtype`` of NxD's parallel layers).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from hlat.parallel import TP_PLAN

    tp = mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    low = any(p.dtype != torch.float32 for p in model.parameters())
    rowwise = _fp32_rowwise if fp32_reduce and low else RowwiseParallel
    styles = {  # the plan's kinds, with where activations live around each layer
        "layers.*.attn.o_proj": rowwise(output_layouts=seq),
        "layers.*.mlp.down": rowwise(output_layouts=seq),
        "embed": rowwise(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    plan = {
        name: styles.get(name, ColwiseParallel() if kind == "colwise" else rowwise()) for name, kind in TP_PLAN.items()
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {
            "norm": SequenceParallel(),
            "layers.*.attn_norm": SequenceParallel(),
            "layers.*.mlp_norm": SequenceParallel(),
            "layers.*.mlp": gather,
            "layers.*.attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
        }
    for block in model.layers:
        _interleave_gate_up(block.mlp.gate_up.weight, tp)
    return parallelize_module(model, mesh, plan)
