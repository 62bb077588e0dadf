"""This host's matrix-multiply peak FLOP/s, measured once and cached: the MFU denominator on CPU.

A CPU has no datasheet peak worth trusting, so it is measured (square matmuls per dtype, best of several windows)
and cached in ``<cache_dir>/peak-<fingerprint>.json``, keyed by everything that changes the answer (CPU model,
usable cores, torch version and threads). ``python -m hlat.plan.peak`` runs it. Imports ``hlat.host`` (and, in
``main``, ``hlat.backends.torch.bf16_matmul``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hlat.host import DEFAULT_CACHE_DIR, host_fingerprint, host_info

DEFAULT_DTYPES = ("float32", "bfloat16")
EMULATED = "_emulated"
"""Suffix of a dtype name measured the emulated bf16 matmuls' way: ``bfloat16_emulated`` times bf16
operands upcast, multiplied in fp32 and rounded back, the matmul a run with ``bf16_matmul=emulated`` does."""


def _dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"bfloat16"``, ``"bfloat16_emulated"``, ...)."""
    dtype = getattr(torch, name.removesuffix(EMULATED), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"unknown torch dtype {name!r}; use a name such as 'float32', 'bfloat16' or 'bfloat16_emulated'"
        )
    return dtype


def peak_key(compute_dtype: str, bf16_matmul: str | None) -> str:
    """The cache key of a run's MFU denominator: ``bfloat16_emulated`` for bf16 under the emulated policy."""
    return compute_dtype + EMULATED if compute_dtype == "bfloat16" and bf16_matmul == "emulated" else compute_dtype


def _sync(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (CUDA runs asynchronously; CPU matmuls return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(
    dtype: torch.dtype,
    *,
    n: int = 2048,
    seconds: float = 1.0,
    device: str = "cpu",
    repeats: int = 5,
    emulated: bool = False,
) -> float:
    """Measure the FLOP/s of square ``n×n`` matmuls in ``dtype`` (``2·n³`` FLOPs each).

    A warm-up of about ``seconds / 2`` (at least two matmuls) first brings the clocks, caches and the BLAS
    thread pool to steady state and times one matmul; from that, each of ``repeats`` timed windows runs a fixed
    number of matmuls lasting about ``seconds``. The best window is returned, not the mean: a peak is what the
    hardware *can* do, and on a shared host the slower windows measure the neighbours (another process on the
    cores, a clock dip), not the hardware. The matmuls use whatever ``torch.get_num_threads()`` is set to.

    Args:
        dtype: Element type of both operands and the result.
        n: Matrix side. Small sizes (a few hundred) do not fill the vector units and underestimate the peak.
        seconds: Approximate length of each timed window.
        device: Torch device string, e.g. ``"cpu"`` or ``"cuda"``; on CUDA the timing synchronizes the device.
        repeats: Number of timed windows.
        emulated: Time ``(a.float() @ b.float()).to(dtype)`` instead: the emulated bf16 matmul (``bf16_policy``).

    Returns:
        The best window's FLOP/s. A dtype with no fast kernel (fp16 on most CPUs) still gets measured, slowly:
        each window runs at least one matmul, however long it takes.

    Raises:
        ValueError: If ``n``, ``seconds`` or ``repeats`` is not positive.
    """
    if n < 1 or seconds <= 0 or repeats < 1:
        raise ValueError(f"n, seconds and repeats must be positive, got n={n}, seconds={seconds}, repeats={repeats}")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    flops_per_matmul = 2.0 * n**3
    matmul = _emulated_matmul(n, dev) if emulated else torch.matmul
    per_matmul = _warm_up(matmul, a, b, c, dev, seconds / 2)
    per_window = max(1, round(seconds / max(per_matmul, 1e-9)))
    best = 0.0
    for _ in range(repeats):
        elapsed = _timed_window(matmul, a, b, c, dev, per_window)
        best = max(best, per_window * flops_per_matmul / elapsed)
    return best


def _emulated_matmul(n: int, dev: torch.device) -> Callable[..., None]:
    """The emulated bf16 matmul (``hlat.backends.torch.bf16_matmul``): upcast, multiply in fp32, round into ``out``."""
    c32 = torch.empty(n, n, device=dev)

    def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        # The upcasts and the rounding are part of every emulated matmul, so they are timed too.
        torch.matmul(a.float(), b.float(), out=c32)
        out.copy_(c32)

    return matmul


def _warm_up(
    matmul: Callable[..., Any], a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dev: torch.device, seconds: float
) -> float:
    """Run matmuls for about ``seconds`` (at least two); the seconds the last one took.

    Each matmul is synchronized, so that the last one gives an honest time per matmul.
    """
    warm_start = time.perf_counter()
    iters, per_matmul = 0, 0.0
    while iters < 2 or time.perf_counter() - warm_start < seconds:
        t0 = time.perf_counter()
        matmul(a, b, out=c)
        _sync(dev)
        per_matmul = time.perf_counter() - t0
        iters += 1
    return per_matmul


def _timed_window(
    matmul: Callable[..., Any], a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dev: torch.device, count: int
) -> float:
    """The seconds ``count`` matmuls take: one clock read and one synchronization on each side of them."""
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(count):
        matmul(a, b, out=c)
    _sync(dev)
    return time.perf_counter() - t0


def cache_path(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The cache file for this host: ``<cache_dir>/peak-<fingerprint>.json`` (``~`` expanded)."""
    return Path(cache_dir).expanduser() / f"peak-{host_fingerprint()}.json"


def measure_and_cache(
    cache_dir: str | Path = DEFAULT_CACHE_DIR, dtypes: Sequence[str] = DEFAULT_DTYPES, **kw: Any
) -> dict[str, float]:
    """Measure the matmul peak of each dtype on this host and write it to :func:`cache_path`.

    The file is replaced (atomically, so a training run reading it never sees half a file) with
    ``{"fingerprint", "host": host_info(), "measured_at": ISO-8601 UTC time, "flops": {dtype name: FLOP/s}}``.

    Args:
        cache_dir: Directory of the cache file; created if missing.
        dtypes: Torch dtype names to measure, e.g. ``("float32", "bfloat16")``.
        **kw: Passed to :func:`measure_matmul_flops` (``n``, ``seconds``, ``repeats``). The cache is keyed by the
            CPU, so leave ``device`` at ``"cpu"``.

    Returns:
        FLOP/s per dtype name, as written.

    Raises:
        ValueError: If a name is not a torch dtype (before anything is measured), or on bad ``kw`` values.
    """
    resolved = {name: _dtype(name) for name in dtypes}
    flops = {
        name: measure_matmul_flops(dtype, emulated=name.endswith(EMULATED), **kw) for name, dtype in resolved.items()
    }
    path = cache_path(cache_dir)
    earlier = {name: cached_peak(name, cache_dir) for name in _cached_names(path)}  # other dtypes measured before
    record = {
        "fingerprint": host_fingerprint(),
        "host": host_info(),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flops": {k: v for k, v in earlier.items() if v is not None} | flops,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return flops


def _cached_names(path: Path) -> list[str]:
    """The dtype names in the cache file at ``path`` (none if it is missing or unreadable)."""
    try:
        return [str(k) for k in json.loads(path.read_text(encoding="utf-8"))["flops"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def cached_peak(dtype_name: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> float | None:
    """This host's cached matmul peak for ``dtype_name``, in FLOP/s.

    Never raises for a bad cache: a training run asking for its MFU denominator must not crash over it.

    Args:
        dtype_name: Torch dtype name, e.g. ``"bfloat16"``.
        cache_dir: Directory given to :func:`measure_and_cache`.

    Returns:
        The FLOP/s, or None if this host (same fingerprint) never measured that dtype, or if the file is
        unreadable, corrupt, records another fingerprint, or holds a value that is not a positive finite number.
    """
    try:
        path = cache_path(cache_dir)
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("fingerprint") != host_fingerprint():
            return None
        value = record["flops"][dtype_name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def first_hint(text: str, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> bool:
    """True the first time this host (same fingerprint) is given the hint ``text``; False every time after.

    The "no MFU: run `hlat bench peak`" hint would otherwise open every run. A marker file next to the peak cache
    (``<cache_dir>/peak-<fingerprint>.hint-<hash of text>``) remembers it was shown; a directory that cannot be
    written says True (the hint is shown again rather than lost).
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    try:
        marker = cache_path(cache_dir).with_suffix(f".hint-{digest}")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.open("x").close()
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """Measure this host's matmul peaks, cache them and print a markdown table of GFLOP/s.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    parser = argparse.ArgumentParser(
        prog="hlat bench peak", description="Measure and cache this host's matmul peak FLOP/s (MFU on CPU)."
    )
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="cache directory (default: %(default)s)")
    parser.add_argument("--size", type=int, default=2048, help="matrix side n (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each timed window (default: 1.0)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per dtype (default: %(default)s)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        help="dtype names, bfloat16_emulated included (default: float32 and bf16 as this host's "
        "precision.bf16_matmul=auto runs it)",
    )
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeats < 1 or not args.seconds > 0:
        parser.error(
            f"--size={args.size} --seconds={args.seconds} --repeats={args.repeats}: the size and the repeats must be "
            ">= 1 and the seconds > 0; e.g. --size 2048 --seconds 1 --repeats 5"
        )
    for name in args.dtypes or ():
        try:
            _dtype(name)
        except ValueError as e:
            parser.error(f"--dtypes: {e}")

    dtypes = args.dtypes
    if dtypes is None:  # bf16 the way training runs it here: native or emulated, whichever the probe found faster
        from hlat.plan.bf16_policy import resolve_policy

        policy, why = resolve_policy("auto", torch.device("cpu"), args.cache_dir)
        dtypes = ["float32", peak_key("bfloat16", policy)]
        print(f"bf16 matmuls: {policy} ({why})")
    flops = measure_and_cache(args.cache_dir, dtypes, n=args.size, seconds=args.seconds, repeats=args.repeats)
    print(
        f"matmul peak, n={args.size}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}\n"
    )
    print("| dtype | GFLOP/s |")
    print("|---|---:|")
    for name, value in flops.items():
        print(f"| {name} | {value / 1e9:.1f} |")
    print(f"\ncache: {cache_path(args.cache_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
