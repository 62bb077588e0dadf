"""Graph hygiene on the real NxD 0.17 (XLA:CPU): after warm-up no step compiles a graph, no step syncs the host.

On Trainium every new XLA graph is a neuronx-cc compile (minutes) and every device-to-host transfer inside a step
cuts the step's graph; torch_xla counts both on XLA:CPU too. The neuron backend logs those counters with the last
row of every log interval (``Backend.host_metrics`` -> ``hlat.backends.neuron_graphs``, ``xla/*``), so one
``python train.py cluster=xla_cpu`` run per precision mode shows both properties in its MLflow history.

What a run compiles (world 1, 2 micro-batches per step; ``PT_XLA_DEBUG_LEVEL=2`` names them): NxD's setup and
model materialization (2 graphs), micro-batch 1 (gradients absent) and micro-batch 2 (accumulating), the optimizer
step of step 1 (AdamW state created) and of the later steps, and ``fetch``'s small graph: 7 in every mode, all by
the second log interval. The counters are read when an interval is flushed, before that interval's fetch, so the
reading of interval i covers everything up to the fetch of interval i - 1.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import ClassVar

import pytest

from hlat.backends.neuron_graphs import CPU_FALLBACKS, DEVICE_TO_HOST, GRAPHS_COMPILED, KEYS, graph_metrics
from tests.neuron.lane import train

INTERVALS = 4
"""Log intervals per run: the first two warm up (the second compiles fetch's graph), the last two are steady."""

MODES = [
    pytest.param(("precision=fp32",), 2, id="fp32"),
    pytest.param(("precision=bf16",), 3, id="bf16"),
    pytest.param(("precision=bf16_sr",), 2, id="bf16_sr"),
    pytest.param(("precision=master_weights", "parallelism.zero1=true"), 3, id="master_weights"),
]
"""Each mode with its log interval (2 or 3 steps, never 1: a per-step transfer must outnumber the per-interval one)."""


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


@pytest.mark.parametrize(("overrides", "every"), MODES)
def test_steady_steps_compile_nothing_and_fetch_once_per_interval(
    tmp_path: Path, cache: Path, overrides: tuple[str, ...], every: int
) -> None:
    """From the second log interval on: ``xla/graphs_compiled`` is flat and one transfer leaves the device per interval.

    Catches a step that recompiles: a Python scalar that the XLA lowering bakes into the graph and that changes every
    step (``x.pow(step)``; torch_xla turns most scalars, the learning rate included, into device data, but keeps 0.0
    and 1.0 as constants, so a schedule that reaches exactly 0 or 1 compiles again), a shape that changes per step (a
    metrics buffer stacked over the run instead of the interval, a shorter last batch, a varying micro-batch count).
    Catches a host sync inside the step: ``.item()``, ``float()``/``bool()`` of a device tensor or printing one
    (e.g. reading the non-finite flag on the host each step, as ``train.on_nonfinite=skip_step`` would), a hook that
    reads a tensor every step, an op without XLA lowering that falls back to the CPU (``xla/cpu_fallback_ops``).
    Any of these makes the transfers per interval grow with its ``every`` steps instead of staying 1 (the fetch).
    Checked by injection into ``forward_backward``: ``float(loss)`` per micro-batch gives 5 transfers per 2-step
    interval (and one more graph); ``loss + (loss * 0).pow(k + 1.5)`` with k counting micro-batches compiles 2 graphs
    per step.
    """
    steps = INTERVALS * every
    keys = (GRAPHS_COMPILED, DEVICE_TO_HOST, CPU_FALLBACKS, "xla/compile_time_s", "train/loss")
    name = "-".join(o.split("=")[1] for o in overrides)
    m = train(
        tmp_path,
        name,
        cache,
        "cluster=xla_cpu",
        *overrides,
        f"train.steps={steps}",
        f"train.log_every={every}",
        keys=("train/loss",),
    )
    # MLflow keeps the loss every step and the other metrics at most every 100 steps: the rest from the run's Parquet
    # series, which holds every logged value.
    from hlat.track.series import read_series, to_points

    table = read_series(tmp_path / name / "checkpoints" / "series")
    m |= {key: to_points(table, key)[1].tolist() for key in keys if key != "train/loss"}
    assert len(m["train/loss"]) == steps and all(math.isfinite(v) for v in m["train/loss"]), m["train/loss"]
    compiled, d2h, fallbacks = m[GRAPHS_COMPILED], m[DEVICE_TO_HOST], m[CPU_FALLBACKS]
    assert len(compiled) == len(d2h) == len(fallbacks) == INTERVALS, m  # logged with each interval's last row
    assert compiled[0] > 0 and m["xla/compile_time_s"][0] > 0, m
    # Steady state: readings 2..4 cover steps every+1 .. 4*every (each reading includes the fetch before it).
    assert compiled[1:] == [compiled[1]] * (INTERVALS - 1), f"a steady step compiled a new graph: {m}"
    per_interval = [b - a for a, b in itertools.pairwise(d2h[1:])]
    assert per_interval == [1.0] * (INTERVALS - 2), f"device-to-host transfers per {every}-step interval: {m}"
    assert fallbacks[1:] == [fallbacks[1]] * (INTERVALS - 1), f"an op fell back to the CPU in a steady step: {m}"
