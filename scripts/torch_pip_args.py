"""The pip options ``make install`` (and ``make demo``, ``make test``) gives torch: CPU wheels where no NVIDIA GPU is.

On Linux, torch from PyPI is the CUDA build: torch plus nvidia-* libraries of several GB, which a machine without an
NVIDIA GPU cannot use. So on Linux, when neither ``/proc/driver/nvidia/version`` nor a working ``nvidia-smi`` shows a
GPU and PyTorch's CPU index (the argument) answers, this prints ``--index-url <that index>``; otherwise it prints
nothing, and pip uses its own index: the CUDA build where a GPU is, PyPI's CPU build on macOS, or whatever a mirror
that serves only PyPI holds. One line on stderr says which and why. ``make install TORCH_PIP_ARGS=...`` skips all of
this (``TORCH_PIP_ARGS=`` alone: pip's own index).

Standard library only: it runs before the virtual environment exists, with the ``python3`` that makes it.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def nvidia_gpu() -> bool:
    """Whether this host shows an NVIDIA GPU: its driver's /proc entry, or ``nvidia-smi -L`` listing one."""
    if Path("/proc/driver/nvidia/version").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


def unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why ``url`` gives no answer at all (None: it answers, whatever the status; a TLS error is an answer too).

    urllib follows the ``https_proxy`` / ``no_proxy`` variables, as pip does.
    """
    try:
        with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/", method="HEAD"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        reason = e.reason
        if type(reason).__name__.startswith("SSL"):
            return None
        return str(getattr(reason, "strerror", None) or reason)
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


def choose(index: str) -> tuple[str, str]:
    """(pip options, why) for torch on this host."""
    if platform.system() != "Linux":
        return "", f"pip's own index ({platform.system()}: PyPI's torch is not the CUDA build there)"
    if nvidia_gpu():
        return "", "pip's own index (an NVIDIA GPU is here: PyPI's CUDA build)"
    why = unreachable(index)
    if why is not None:
        return "", (
            f"pip's own index: no NVIDIA GPU here, but {index} does not answer ({why}); from PyPI on Linux that is "
            "the CUDA build, several GB"
        )
    return f"--index-url {index}", f"CPU wheels from {index} (no NVIDIA GPU here)"


def main(argv: list[str]) -> int:
    """Print the options for the index ``argv[0]`` (default :data:`CPU_INDEX`), and why on stderr."""
    options, why = choose(argv[0] if argv else CPU_INDEX)
    print(f"torch: {why}; to choose: make install TORCH_PIP_ARGS=... (empty: pip's own index)", file=sys.stderr)
    print(options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
