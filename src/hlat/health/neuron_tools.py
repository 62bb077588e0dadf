"""The Neuron system tools, where installed: ``neuron-ls`` (devices visible) and ``nccom-test`` (collective speed).

Run through ``subprocess`` and parsed (nothing imports the Neuron packages); skipped where absent. The formats are
the Neuron documentation's (``tools/neuron-sys-tools/``): neither tool has been run by hlat on a trn1 host, the
parsers are tested on the documented sample output.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field

GIB_PER_GB = 2**30 / 1e9
TIMEOUT_S = 300.0
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
_AVG = re.compile(r"Avg bus bandwidth:\s*([\d.]+)\s*GB/s", re.IGNORECASE)


@dataclass
class ToolResult:
    """What one node-level tool found."""

    node: str
    """Host it ran on."""
    tool: str
    """``neuron-ls`` or ``nccom-test allr`` / ``nccom-test allg``."""
    ok: bool
    """False: the tool failed or found too little (the node fails the check)."""
    summary: str
    """One line for the report."""
    figures: dict[str, float] = field(default_factory=dict)
    """Numbers for MLflow: ``neuroncores``, ``busbw_gbps`` (GB/s, converted from nccom-test's GiB/s), ..."""


def parse_neuron_ls(text: str) -> list[dict]:
    """The device objects of ``neuron-ls --json-output``.

    Raises:
        ValueError: The text is not a JSON list of objects with ``nc_count``.
    """
    devices = json.loads(text)
    if not isinstance(devices, list) or not all(isinstance(d, dict) and "nc_count" in d for d in devices):
        raise ValueError("neuron-ls --json-output did not print a list of devices with nc_count")
    return devices


def parse_nccom_test(text: str) -> tuple[list[dict[str, float]], float | None, list[str]]:
    """Rows, average bus bandwidth (GiB/s, as printed) and error lines of an ``nccom-test`` run."""
    rows, errors, avg = [], [], None
    for line in text.splitlines():
        if m := _ROW.match(line):
            size, count, _dtype, t_us, algbw, busbw = m.groups()
            rows.append(
                {
                    "size_bytes": float(size),
                    "count": float(count),
                    "time_us": float(t_us),
                    "algbw_gibps": float(algbw),
                    "busbw_gibps": float(busbw),
                }
            )
        elif m := _AVG.search(line):
            avg = float(m.group(1))
        elif re.search(r"fail|error|not running", line, re.IGNORECASE):
            errors.append(line.strip())
    return rows, avg, errors


def neuron_ls(node: str, nproc: int) -> ToolResult | None:
    """Run ``neuron-ls --json-output``: NeuronCores for the ``nproc`` ranks of this node? None: not installed."""
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--json-output"], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        devices = parse_neuron_ls(r.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return ToolResult(node, "neuron-ls", False, f"no devices: {_first_line(str(e))}")
    if r.returncode != 0:
        return ToolResult(node, "neuron-ls", False, f"exit {r.returncode}: {_first_line(r.stderr)}")
    cores = sum(int(d["nc_count"]) for d in devices)
    memory = sum(int(d.get("memory_size", 0)) for d in devices)
    ok = cores >= nproc
    summary = f"{len(devices)} device(s), {cores} NeuronCore(s), {memory / 2**30:.0f} GiB" + (
        "" if ok else f": fewer NeuronCores than the {nproc} processes of this node"
    )
    return ToolResult(node, "neuron-ls", ok, summary, {"neuron_devices": len(devices), "neuroncores": cores})


def nccom_test(node: str, op: str, nproc: int, nbytes: int, min_gbps: float | None = None) -> ToolResult | None:
    """Run ``nccom-test`` for ``op`` (``allr`` or ``allg``) over ``nproc`` ranks of this node. None: not installed.

    ``min_gbps``: the node fails below this bus bandwidth (GB/s); None: only a failed run fails it.
    """
    exe = shutil.which("nccom-test")
    if exe is None:
        return None
    cmd = [exe, "-r", str(nproc), "-b", str(nbytes), "-e", str(nbytes), "-d", "fp32", op]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return ToolResult(node, f"nccom-test {op}", False, f"did not run: {_first_line(str(e))}")
    rows, avg, errors = parse_nccom_test(r.stdout + "\n" + r.stderr)
    tool = f"nccom-test {op}"
    if r.returncode != 0 or errors or not rows:
        why = errors[0] if errors else _first_line(r.stderr) or f"exit {r.returncode}, no result rows"
        return ToolResult(node, tool, False, why)
    busbw = (avg if avg is not None else rows[-1]["busbw_gibps"]) * GIB_PER_GB
    ok = min_gbps is None or busbw >= min_gbps
    summary = f"{nproc} ranks, {nbytes / 2**20:g} MiB: bus bandwidth {busbw:.2f} GB/s, {rows[-1]['time_us']:g} µs" + (
        "" if ok else f", below {min_gbps:.2f} GB/s"
    )
    return ToolResult(node, tool, ok, summary, {"busbw_gbps": busbw, "time_us": rows[-1]["time_us"]})


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""
