"""This host's fingerprint (CPU model, usable cores, torch version and threads), the key of every per-host cache.

A cache directory shared between machines (:mod:`hlat.plan.peak`, :mod:`hlat.plan.bf16_policy`) thus never hands one
host another's numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform

import torch

DEFAULT_CACHE_DIR = "~/.cache/hlat"
"""Where per-host measurements are cached when no ``data.cache_dir`` says otherwise."""


def _cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()`` or the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_info() -> dict[str, str | int]:
    """The inputs of :func:`host_fingerprint` (what decides this host's matmul peak): cpu, cores, torch, threads."""
    return {
        "cpu": _cpu_model(),
        "cores": _usable_cores(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def host_fingerprint() -> str:
    """A short stable id of this host's compute: 12 hex characters of a SHA-256 over :func:`host_info`."""
    blob = json.dumps(host_info(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
