"""This host, as the measurements cached on it know it: CPU model, usable cores, torch version and threads.

The fingerprint keys every per-host cache (the matmul peak of :mod:`hlat.plan.peak`, the bf16 matmul probe of
:mod:`hlat.plan.bf16_policy`), so a cache directory shared between machines never hands one host another's numbers.
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
    """The inputs of :func:`host_fingerprint`: what decides this host's matmul peak.

    Returns:
        ``{"cpu": model name, "cores": usable cores, "torch": torch version, "threads": torch.get_num_threads()}``.
    """
    return {
        "cpu": _cpu_model(),
        "cores": _usable_cores(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def host_fingerprint() -> str:
    """A short stable id of this host's compute: 12 hex characters of a SHA-256 over :func:`host_info`.

    Changing the CPU model, the usable cores (affinity, container limits), the torch version or
    ``torch.set_num_threads`` changes the id, so a cached peak is only reused under the same conditions.
    """
    blob = json.dumps(host_info(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
