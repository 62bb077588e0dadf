"""SpikeDetector against an independent re-implementation of the paper's definition (arXiv 2404.10630 §4.1).

Every statistic the detector exposes is compared: the live row of each step (``spike/active``, ``spike/length``,
``spike/count``, ``spike/limit``), ``count``, ``length``, ``durations``, ``histogram()``, ``summary()`` and the
``state_dict()`` round trip. The summary must never crash, whatever durations the spikes had (issue 21).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hlat.backends.torch.backend import TorchBackend
from hlat.state import StepOutput, TrainState
from hlat.track.metrics import MetricsLogger, SpikeDetector
from tests.conftest import backend_config

NAN, INF = float("nan"), float("inf")


@dataclass
class Reference:
    """The paper's definition, written out step by step with plain lists (no shared code with SpikeDetector)."""

    rows: list[dict[str, float]] = field(default_factory=list)
    """What each step should report: {} until ``window`` finite norms were seen."""
    spikes: list[int] = field(default_factory=list)
    """Duration of every spike in the order they started; the last one may still be open."""
    open: bool = False
    """Whether the last spike is still in progress at the end of the series."""


def reference(norms: list[float], window: int, threshold: float) -> Reference:
    """r = mean of the previous ``window`` finite norms; a step is in a spike when its norm > r + threshold.

    A spike starts at the first such step and lasts while the following steps are too; a non-finite norm counts as
    above the limit and never enters the mean (the detector's documented handling of overflow).
    """
    ref, finite = Reference(), []
    for norm in norms:
        if len(finite) < window:
            ref.rows.append({})
        else:
            previous = finite[len(finite) - window :]
            limit = sum(previous) / window + threshold
            above = not math.isfinite(norm) or norm > limit
            if above and ref.open:
                ref.spikes[-1] += 1
            elif above:
                ref.spikes.append(1)
            ref.open = above
            length = ref.spikes[-1] if above else 0
            ref.rows.append(
                {
                    "spike/active": float(above),
                    "spike/length": float(length),
                    "spike/count": float(len(ref.spikes)),
                    "spike/limit": limit,
                }
            )
        if math.isfinite(norm):
            finite.append(norm)
    return ref


def assert_matches(det: SpikeDetector, ref: Reference) -> None:
    """Every end-of-series statistic of ``det`` equals the reference's."""
    finished = ref.spikes[:-1] if ref.open else ref.spikes
    n = len(ref.spikes)
    assert det.count == n
    assert det.length == (ref.spikes[-1] if ref.open else 0)
    assert det.durations == Counter(finished)
    hist = det.histogram()
    assert hist == Counter(ref.spikes) and list(hist) == sorted(hist) and all(v > 0 for v in hist.values())
    summary = det.summary()
    assert set(summary) == {"spike/summary_count", "spike/single_step_fraction", "spike/longest", "spike/mean_duration"}
    assert summary["spike/summary_count"] == n
    assert summary["spike/single_step_fraction"] == pytest.approx(ref.spikes.count(1) / n if n else 0.0)
    assert summary["spike/longest"] == max(ref.spikes, default=0)
    assert summary["spike/mean_duration"] == pytest.approx(sum(ref.spikes) / n if n else 0.0)
    assert all(isinstance(v, float) and math.isfinite(v) for v in summary.values())


def run_both(norms: list[float], window: int, threshold: float) -> tuple[SpikeDetector, Reference]:
    det, ref = SpikeDetector(window, threshold), reference(norms, window, threshold)
    assert [det.update(x) for x in norms] == ref.rows
    return det, ref


# Values clustered around 1 so that spikes of every length (and spikes still open at the end) are common.
norm_values = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 1.0, 1.05, 1.2, 2.0, 5.0, 20.0]),
    st.floats(min_value=0.0, max_value=50.0, allow_nan=False),
    st.sampled_from([NAN, INF]),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    norms=st.lists(norm_values, max_size=60),
    window=st.integers(min_value=1, max_value=6),
    threshold=st.sampled_from([0.0, 0.1, 0.5, 2.0]),
    split=st.integers(min_value=0, max_value=60),
)
@example(norms=[1.0, 1.0, 5.0, 5.0, 1.0], window=2, threshold=0.1, split=3)  # issue 21: KeyError: 1
@example(norms=[1.0] * 10, window=3, threshold=0.1, split=5)  # no spike
@example(norms=[1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 5.0, 9.0, 20.0, 1.0], window=2, threshold=0.1, split=7)  # only long
@example(norms=[1.0, 1.0, 1.0, 5.0, 9.0], window=2, threshold=0.1, split=4)  # a spike still open at the end
@example(norms=[1.0, 1.0, NAN, INF, 1.0], window=2, threshold=0.1, split=3)  # non-finite norms
def test_every_statistic_matches_the_definition(norms: list[float], window: int, threshold: float, split: int) -> None:
    det, ref = run_both(norms, window, threshold)
    assert_matches(det, ref)
    # A run resumed from a checkpoint taken after step `split` reports the same statistics.
    split = min(split, len(norms))
    first = SpikeDetector(window, threshold)
    for x in norms[:split]:
        first.update(x)
    resumed = SpikeDetector(window, threshold)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.update(x) for x in norms[split:]] == ref.rows[split:]
    assert_matches(resumed, ref)


def test_the_issue_repro_reports_one_two_step_spike() -> None:
    det, _ = run_both([1.0, 1.0, 5.0, 5.0, 1.0], 2, 0.1)
    assert det.histogram() == {2: 1}
    assert det.summary() == {
        "spike/summary_count": 1.0,
        "spike/single_step_fraction": 0.0,
        "spike/longest": 2.0,
        "spike/mean_duration": 2.0,
    }


def test_no_spike_gives_zeros() -> None:
    det, _ = run_both([1.0] * 10, 3, 0.1)
    assert det.histogram() == {} and det.count == 0
    assert det.summary() == {
        "spike/summary_count": 0.0,
        "spike/single_step_fraction": 0.0,
        "spike/longest": 0.0,
        "spike/mean_duration": 0.0,
    }


def test_only_long_spikes() -> None:
    det, _ = run_both([1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 5.0, 9.0, 20.0, 1.0], 2, 0.1)
    assert det.histogram() == {2: 1, 3: 1} and det.length == 0
    s = det.summary()
    assert s["spike/summary_count"] == 2 and s["spike/single_step_fraction"] == 0.0
    assert s["spike/longest"] == 3 and s["spike/mean_duration"] == 2.5


def test_a_spike_still_open_at_the_end_is_counted() -> None:
    det, _ = run_both([1.0, 1.0, 1.0, 5.0, 9.0], 2, 0.1)
    assert det.length == 2 and det.durations == Counter() and det.count == 1
    assert det.histogram() == {2: 1}
    s = det.summary()
    assert s["spike/summary_count"] == 1 and s["spike/longest"] == 2 and s["spike/single_step_fraction"] == 0.0


def test_metrics_logger_summaries_with_only_multi_step_spikes() -> None:
    # Grad norms with a 2-step and a 3-step spike and no single-step one; summaries are due at steps 3, 6, 9 and
    # at the last step 10. Before the fix the first summary after the first spike raised KeyError: 1.
    norms = [1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 5.0, 9.0, 20.0, 1.0]
    sunk: list = []
    backend = TorchBackend(backend_config())
    logger = MetricsLogger(
        backend,
        torch.nn.Linear(2, 2),
        sunk.append,
        every=2,
        last_step=len(norms),
        tokens_per_step=8,
        spikes=SpikeDetector(2, 0.1),
        spike_summary_every=3,
    )
    state = TrainState()
    for step, norm in enumerate(norms, start=1):
        state.step = step
        logger(state, StepOutput(torch.tensor(1.0), torch.tensor(norm), 1e-3, 0.0))
    rows = dict(row for batch in sunk for row in batch)
    summaries = {s: r for s, r in rows.items() if "spike/summary_count" in r}
    assert set(summaries) == {4, 6, 10}  # the flushes (every 2) that cross a multiple of 3, and the last step
    assert summaries[4]["spike/summary_count"] == 1 and summaries[4]["spike/longest"] == 2
    assert summaries[10] == {
        **summaries[10],
        "spike/summary_count": 2.0,
        "spike/single_step_fraction": 0.0,
        "spike/longest": 3.0,
        "spike/mean_duration": 2.5,
    }
    assert [rows[s]["spike/active"] for s in range(3, 11)] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
