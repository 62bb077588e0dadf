"""Which bf16 matmul is faster on this host, native or emulated in fp32: measured once, cached per host.

``precision.bf16_matmul=auto`` takes the faster (``resolve_policy``), decided by measurement rather than by a list
of CPU names: ``probe`` times a native bf16 GEMM against the emulated one (bf16 operands upcast, multiplied in
fp32, rounded back) on the run's device, cached per host fingerprint (``hlat.host``) like the matmul peak
(``hlat.plan.peak``). The torch backend applies the policy (``hlat.backends.torch.bf16_matmul``); the neuron
backend's bf16 is the hardware's. May import: ``hlat.host``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

POLICIES = ("auto", "native", "emulated")
"""Values of ``precision.bf16_matmul``."""
PROBE_SIZE = 512
"""Side of the probe's square GEMMs: large enough to fill a vector unit, small enough that a slow bf16 fallback
(~1 GFLOP/s) still takes well under a second."""


def _best_rate(fn: Callable[[], Any], flops: float, device: torch.device, budget_s: float) -> float:
    """The best FLOP/s of ``fn`` over a warm-up call and timed calls filling ``budget_s`` (at least one)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best, start = 0.0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        sync()
        best = max(best, flops / max(time.perf_counter() - t0, 1e-9))
        if time.perf_counter() - start > budget_s:
            return best


def probe(device: str | torch.device = "cpu", n: int = PROBE_SIZE, budget_s: float = 0.3) -> dict[str, float]:
    """GFLOP/s of an ``n×n`` GEMM in fp32, in native bf16 and in emulated bf16 (upcast, fp32 GEMM, round) here.

    Each is the best of repeated calls within ``budget_s``, after a warm-up call; the three are measured in
    one process back to back, so a busy machine slows all three alike.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(n, n, generator=gen).to(dev) for _ in range(2))
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    flops = 2.0 * n**3
    return {
        "float32": _best_rate(lambda: a32 @ b32, flops, dev, budget_s) / 1e9,
        "bf16_native": _best_rate(lambda: a16 @ b16, flops, dev, budget_s) / 1e9,
        "bf16_emulated": _best_rate(lambda: (a16.float() @ b16.float()).bfloat16(), flops, dev, budget_s) / 1e9,
    }


def _cache_file(cache_dir: str | Path, device: torch.device) -> Path:
    """``<cache_dir>/bf16-matmul-<host fingerprint>[-<gpu name>].json``."""
    from hlat.host import host_fingerprint

    suffix = ""
    if device.type == "cuda":
        suffix = "-" + "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device))
    return Path(cache_dir).expanduser() / f"bf16-matmul-{host_fingerprint()}{suffix}.json"


def cached_probe(device: torch.device, cache_dir: str | Path) -> dict[str, float]:
    """This host's probe figures, measured on first use and cached (a corrupt or foreign cache is measured again)."""
    path = _cache_file(cache_dir, device)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        rates = record["gflops"]
        if all(isinstance(rates.get(k), (int, float)) and rates[k] > 0 for k in ("bf16_native", "bf16_emulated")):
            return {k: float(v) for k, v in rates.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    rates = probe(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"gflops": rates, "size": PROBE_SIZE}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)  # atomic: ranks probing at once each write a whole file
    except OSError:
        pass  # an unwritable cache only costs the probe again next time
    return rates


def resolve_policy(requested: str, device: torch.device, cache_dir: str | Path) -> tuple[str, str]:
    """The policy to run (``native`` or ``emulated``) and why, for ``precision.bf16_matmul=requested``.

    ``auto`` takes whichever of the native and the emulated bf16 GEMM the (cached) probe found faster.
    """
    if requested not in POLICIES:
        raise ValueError(f"precision.bf16_matmul={requested!r} is not one of {', '.join(POLICIES)}")
    if requested != "auto":
        return requested, f"precision.bf16_matmul={requested}"
    rates = cached_probe(device, cache_dir)
    native, emulated = rates["bf16_native"], rates["bf16_emulated"]
    policy = "native" if native >= emulated else "emulated"
    return policy, f"auto: bf16 GEMM native {native:.1f} vs emulated {emulated:.1f} GFLOP/s on this host"
