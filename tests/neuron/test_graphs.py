"""The ``xla/*`` interval metrics: how ``hlat.backends.neuron_graphs`` reads torch-xla 2.9's counters.

Graph hygiene itself (after warm-up no step compiles a graph, no step syncs the host, one transfer per fetch) is
checked per phase, in every precision mode, from the twins that ``hlat graphs plan`` traces of the precision
ablation (``test_graph_plan.py``): the graph ledger counts compiles, transfers and CPU fallbacks per phase, which
says more than these cumulative interval counters, and the lane runs one process per mode instead of two.
"""

from __future__ import annotations

from typing import ClassVar

from hlat.backends.neuron_graphs import KEYS, graph_metrics


class FakeMetrics:
    """``torch_xla.debug.metrics`` as ``graph_metrics`` reads it, with torch-xla 2.9's conventions."""

    METRICS: ClassVar[dict[str, tuple]] = {
        "CompileTime": (7, 4.5e9, ()),
        "ExecuteTime": (25, 1e6, ()),
        "TransferFromDeviceTime": (3, 9e5, ()),
    }
    COUNTERS: ClassVar[dict[str, int]] = {
        "aten::_local_scalar_dense": 2,
        "aten::nonzero": 1,
        "MarkStep": 40,
        "UncachedCompile": 7,
    }

    def metric_data(self, name: str) -> tuple | None:
        return self.METRICS.get(name)  # None: no sample yet

    def counter_names(self) -> list[str]:
        return list(self.COUNTERS)

    def counter_value(self, name: str) -> int | None:
        return self.COUNTERS.get(name)


def test_graph_metrics_reads_counts_and_converts_nanoseconds() -> None:
    """Sample counts, nanosecond totals in seconds, absent metrics as 0, every ``aten::`` counter summed."""
    assert graph_metrics(FakeMetrics()) == dict(zip(KEYS, [7.0, 4.5, 25.0, 3.0, 0.0, 3.0], strict=True))
