"""Graph hygiene of the neuron backend: torch_xla's debug counters as plain host numbers (``xla/*`` metrics).

Reading them is a host-side lookup in torch_xla's process-wide counters (``torch_xla.debug.metrics``): no graph, no
transfer, no synchronisation. Imports nothing of torch_xla: ``NeuronBackend`` hands it that module. Also the
backend's graph ledger (``hlat.backends.graphs``) on those counters, and ``fetch``'s step closure.
What each torch-xla 2.9 metric counts: docs/trn1.md, "Graph hygiene".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hlat.backends.graphs import GraphLedger, HloTail, hlo_dump_env

NS = 1e-9
"""Seconds per nanosecond: torch_xla's timing metrics accumulate nanoseconds."""

GRAPHS_COMPILED = "xla/graphs_compiled"
COMPILE_TIME_S = "xla/compile_time_s"
EXECUTIONS = "xla/executions"
DEVICE_TO_HOST = "xla/device_to_host_transfers"
HOST_TO_DEVICE = "xla/host_to_device_transfers"
CPU_FALLBACKS = "xla/cpu_fallback_ops"
KEYS = (GRAPHS_COMPILED, COMPILE_TIME_S, EXECUTIONS, DEVICE_TO_HOST, HOST_TO_DEVICE, CPU_FALLBACKS)
"""Every metric ``graph_metrics`` returns, in order."""


def _metric(met: Any, name: str) -> tuple[int, float]:
    """``(samples, accumulated sum)`` of the torch_xla metric ``name``; (0, 0.0) before its first sample."""
    data = met.metric_data(name)
    if data is None:
        return 0, 0.0
    return int(data[0]), float(data[1])


def graph_metrics(met: Any) -> dict[str, float]:
    """This process's XLA graph counters so far, as floats under their MLflow names (``KEYS``).

    ``xla/graphs_compiled`` (``CompileTime`` samples), ``xla/compile_time_s`` (their total, seconds),
    ``xla/executions`` (``ExecuteTime`` plus ``ExecuteReplicatedTime`` samples), ``xla/device_to_host_transfers``
    (``TransferFromDeviceTime`` samples), ``xla/host_to_device_transfers`` (``TransferToDeviceTime`` samples) and
    ``xla/cpu_fallback_ops`` (the sum of the ``aten::*`` counters). Host-side only: safe at any point of a step.

    Args:
        met: The ``torch_xla.debug.metrics`` module (``metric_data``, ``counter_names``, ``counter_value``).

    Returns:
        The counters, cumulative since torch_xla was imported.
    """
    compiled, compile_ns = _metric(met, "CompileTime")
    # Executions are recorded when they end, asynchronously: a reading can miss the graphs still running.
    executed = _metric(met, "ExecuteTime")[0] + _metric(met, "ExecuteReplicatedTime")[0]
    fallbacks = sum(met.counter_value(n) or 0 for n in met.counter_names() if n.startswith("aten::"))
    return {
        GRAPHS_COMPILED: float(compiled),
        COMPILE_TIME_S: compile_ns * NS,
        EXECUTIONS: float(executed),
        DEVICE_TO_HOST: float(_metric(met, "TransferFromDeviceTime")[0]),
        HOST_TO_DEVICE: float(_metric(met, "TransferToDeviceTime")[0]),
        CPU_FALLBACKS: float(fallbacks),
    }


def compile_counters(met: Any) -> Callable[[], tuple[int, float]]:
    """Reads (graphs compiled, compile seconds) of this process: a counter lookup, the time only when it moved.

    ``UncachedCompile`` counts the graphs torch-xla had not compiled in this process (on trn1: a neuronx-cc run or
    a Neuron persistent cache hit); ``CompileTime`` sums their compile time.
    """
    last = [-1, 0.0]

    def read() -> tuple[int, float]:
        count = int(met.counter_value("UncachedCompile") or 0)
        if count != last[0]:
            last[:] = [count, _metric(met, "CompileTime")[1] * NS]
        return count, last[1]

    return read


def neuron_ledger(met: Any, hlo_dir: str | None, rank: int) -> GraphLedger:
    """This rank's graph ledger (compile counts and times).

    With ``hlo_dir`` (``health.graph_hlo_dir``) it also fingerprints every graph run and counts each phase's
    device-to-host transfers and CPU fallbacks.
    """
    if hlo_dir is None:
        return GraphLedger(compile_counters(met))
    hlo = HloTail(Path(hlo_dump_env(hlo_dir, rank)["XLA_SAVE_TENSORS_FILE"] + ".0"))  # torch-xla's ordinal 0

    def hygiene() -> tuple[int, int]:  # a planning trace: every counter, per phase
        m = graph_metrics(met)
        return int(m[DEVICE_TO_HOST]), int(m[CPU_FALLBACKS])

    return GraphLedger(compile_counters(met), hlo, hygiene=hygiene)


def emit(values: torch.Tensor, names: list[str], sizes: list[int], fn: Callable) -> None:
    """Step closure of ``NeuronBackend.fetch``: one device-to-host copy, split back into named lists of floats."""
    host = values.cpu().tolist()
    out, i = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = host[i : i + size]
        i += size
    fn(out)
