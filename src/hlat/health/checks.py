"""What the pre-flight check measures on one rank: the device's answer, matmul FLOP/s, collective speed.

Every figure is timed on the host around device work that is waited for (``sync``). Bus bandwidth follows
nccl-tests: all-reduce ``S / t x 2(n-1)/n``, all-gather ``S / t x (n-1)/n``, in GB/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hlat.config import ConfigError

Sync = Callable[[], None]

WARMUP = 2
"""Untimed calls before each timed collective loop (connection setup, NCCL communicator init)."""
LATENCY_REPEAT = 4
"""The 1-element all-reduce that measures latency runs this many times ``health.collective_iters``."""


def device_sync(device: torch.device, sync: Sync | None = None) -> Sync:
    """The function that waits for ``device``'s queued work: ``sync`` if given, else CPU (none) or CUDA's.

    Raises:
        ConfigError: On another device type without ``sync`` (timings would only measure the host's queueing).
    """
    if sync is not None:
        return sync
    if device.type == "cpu":
        return lambda: None
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    raise ConfigError(
        f"the pre-flight check cannot time work on a {device.type} device without the backend's synchronization "
        "(Backend.synchronize); set health.preflight=off to train without it"
    )


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """All-gather ``inp`` of every rank into the flat ``out`` (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class Throttle(TorchFunctionMode):
    """Slows every ``torch.matmul`` inside it to ``factor`` of its speed (the test hook ``health.inject_slow_rank``)."""

    def __init__(self, factor: float, sync: Sync) -> None:
        super().__init__()
        self.factor, self.sync = factor, sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func is torch.matmul:
            self.sync()
            time.sleep((time.perf_counter() - t0) * (1 / self.factor - 1))
        return out


def check_device(device: torch.device, sync: Sync, n: int = 256) -> tuple[bool, str]:
    """Does the device compute a known fp32 matmul correctly (against float64 on the CPU)? (ok, what was found).

    A relative error above 1e-2 (far beyond TF32's or bf16's) or a non-finite value means broken hardware or driver.
    """
    g = torch.Generator().manual_seed(1234)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    want = a @ a.T
    try:
        x = a.to(device=device, dtype=torch.float32)
        got = (x @ x.T).to("cpu", torch.float64)
        sync()
    except RuntimeError as e:  # a device that cannot even run it
        return False, f"matmul failed: {str(e).splitlines()[0]}"
    if not torch.isfinite(got).all():
        return False, "matmul returned non-finite values"
    err = float((got - want).norm() / want.norm())
    return (err < 1e-2, f"matmul relative error {err:.1e}")


def check_all_reduce(device: torch.device, world: int, group: Any = None) -> tuple[bool, str]:
    """Does an all-reduce of ``rank + 1`` return ``world (world + 1) / 2`` on every element?"""
    t = torch.full((1024,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t, group=group)
    want = world * (world + 1) / 2
    got = t.to("cpu")
    ok = bool((got == want).all())
    return (
        ok,
        "all-reduce correct"
        if ok
        else f"all-reduce returned {got.min().item():g}..{got.max().item():g}, want {want:g}",
    )


def matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    seconds: float,
    repeats: int,
    sync: Sync | None = None,
    emulated: bool = False,
) -> float:
    """Best-window FLOP/s of ``n x n`` matmuls on ``device`` (CPU, CUDA: :func:`hlat.plan.peak.measure_matmul_flops`).

    On a lazy device, a chain ``x = (x @ b) * s`` per window, which a graph compiler can neither drop nor merge.
    """
    if device.type in ("cpu", "cuda"):
        from hlat.plan.peak import measure_matmul_flops

        return measure_matmul_flops(dtype, n=n, seconds=seconds, device=str(device), repeats=repeats, emulated=emulated)
    wait = device_sync(device, sync)
    g = torch.Generator().manual_seed(0)
    b = (torch.randn(n, n, generator=g) / n**0.5).to(device=device, dtype=dtype)
    x = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)

    def window(k: int) -> float:
        nonlocal x
        wait()
        t0 = time.perf_counter()
        for _ in range(k):
            x = torch.matmul(x, b) * 0.5
        wait()
        return time.perf_counter() - t0

    window(2)  # warm-up (and compilation of the 2-matmul graph)
    k = max(1, round(seconds / max(window(2) / 2, 1e-9)))
    window(k)  # a lazy device compiles a k-matmul graph once: not in the timed windows
    return max(k * 2.0 * n**3 / window(k) for _ in range(repeats))


def time_collective(op: Callable[[], Any], iters: int, sync: Sync, group: Any = None) -> float:
    """Seconds per call of ``op`` (a blocking collective): ``WARMUP`` calls, a barrier, then ``iters`` timed ones."""
    for _ in range(WARMUP):
        op()
    sync()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    sync()
    return (time.perf_counter() - t0) / iters


def collective_figures(
    device: torch.device, sync: Sync, nbytes: int, iters: int, group: Any = None, size: int | None = None
) -> dict[str, float]:
    """All-reduce and all-gather bus bandwidth (GB/s) and 1-element all-reduce latency (µs) over ``group``.

    ``nbytes``: the all-reduce buffer per rank and the all-gather's output; ``group`` None: the whole job.
    """
    n = size or dist.get_world_size()
    numel = max(n, nbytes // 4 // n * n)  # fp32; the all-gather splits it evenly
    buf = torch.zeros(numel, device=device)  # zeros stay zeros however often they are summed
    part = torch.zeros(numel // n, device=device)
    one = torch.zeros(1, device=device)
    t_ar = time_collective(lambda: dist.all_reduce(buf, group=group), iters, sync, group)
    t_ag = time_collective(lambda: all_gather_flat(buf, part, group), iters, sync, group)
    t_lat = time_collective(lambda: dist.all_reduce(one, group=group), iters * LATENCY_REPEAT, sync, group)
    size_b = numel * 4
    return {
        "allreduce_busbw_gbps": size_b / t_ar * 2 * (n - 1) / n / 1e9,
        "allgather_busbw_gbps": size_b / t_ag * (n - 1) / n / 1e9,
        "latency_us": t_lat * 1e6,
    }
