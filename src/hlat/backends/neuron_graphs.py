"""Graph hygiene of the neuron backend: torch_xla's debug counters as plain host numbers (``xla/*`` metrics).

On Trainium every new XLA graph is a neuronx-cc compile (minutes) and every device-to-host transfer inside a step
cuts the step's graph in two. torch_xla counts both in its process-wide debug metrics (``torch_xla.debug.metrics``),
on the Neuron device as on XLA:CPU, so a run can log them and a test can assert that, after the first steps, no
graph is compiled any more and data leaves the device only at log intervals (``tests/neuron/test_graphs.py``).

Reading them is a host-side lookup in the runtime's counters: it adds no graph, no transfer, no synchronisation.
The values are cumulative over the process (since ``import torch_xla``); a flat ``xla/graphs_compiled`` over the
steady state is the property to watch. This module imports nothing of torch_xla: ``NeuronBackend.host_metrics``
(``hlat.backends.neuron``, the one module that imports it) hands it the ``torch_xla.debug.metrics`` module.

torch-xla 2.9's metrics (``metric_data(name)`` -> ``(count, sum, samples)`` or None before the first sample, times
in nanoseconds):

- ``CompileTime``: one sample per XLA computation compiled (a graph not found in the in-memory cache; on trn1 the
  neuronx-cc invocation or the Neuron persistent cache lookup happens inside it). Recorded synchronously, by the
  ``mark_step`` that compiles.
- ``ExecuteTime`` (``ExecuteReplicatedTime`` with SPMD): one sample per graph executed, recorded when the execution
  ends, asynchronously: a reading can miss the graphs still running.
- ``TransferFromDeviceTime``: one sample per device-to-host transfer (a ``.cpu()``, ``.item()``, ``.tolist()``, a
  print of a device tensor, a CPU fallback op's input), however many tensors it moves.
- ``TransferToDeviceTime``: one sample per host-to-device transfer (batches, Python scalars that become device data).

Counters: ``aten::*`` count the ops that ran on the CPU because torch_xla has no lowering for them (their inputs go
to the host); ``aten::_local_scalar_dense`` is ``.item()``.
"""

from __future__ import annotations

from typing import Any

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
