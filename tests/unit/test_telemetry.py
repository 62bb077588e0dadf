"""Telemetry arithmetic: the paper's gradient-spike definition, FLOPs per token, MFU and cost."""

from __future__ import annotations

import math

import pytest

from hlat.config import ClusterConfig
from hlat.model import count_params
from hlat.track.metrics import SpikeDetector, Throughput, flops_per_token, resolve_peak_flops
from tests.conftest import compose_cfg


def brute_force_spikes(norms: list[float], window: int, threshold: float) -> tuple[list[bool], list[int]]:
    """Straight from the definition: per step, is it above mean(previous `window`) + threshold; spike durations."""
    active = [i >= window and norms[i] > sum(norms[i - window : i]) / window + threshold for i in range(len(norms))]
    durations, run = [], 0
    for a in active:
        if a:
            run += 1
        elif run:
            durations.append(run)
            run = 0
    if run:
        durations.append(run)
    return active, durations


def test_known_spikes_on_a_synthetic_series() -> None:
    # Flat at 1.0 with a 1-step spike at 30, a 3-step spike at 50-52, and another 1-step spike at 80.
    norms = [1.0] * 100
    norms[30] = 2.0
    norms[50:53] = [3.0, 3.0, 3.0]
    norms[80] = 1.5
    det = SpikeDetector(window=20, threshold=0.1)
    rows = [det.update(n) for n in norms]
    assert rows[19] == {} and "spike/active" in rows[20]  # detection starts once the window is full
    assert [i for i, r in enumerate(rows) if r.get("spike/active")] == [30, 50, 51, 52, 80]
    assert rows[51]["spike/length"] == 2 and rows[52]["spike/count"] == 2
    assert rows[30]["spike/limit"] == pytest.approx(1.1)
    assert det.histogram() == {1: 2, 3: 1}
    s = det.summary()
    assert s["spike/summary_count"] == 3 and s["spike/longest"] == 3
    assert s["spike/single_step_fraction"] == pytest.approx(2 / 3)
    assert s["spike/mean_duration"] == pytest.approx(5 / 3)


def test_the_running_mean_includes_spike_steps() -> None:
    # 20 ones, then 1.5 for many steps: the mean catches up, so the spike ends after a few steps on its own.
    norms = [1.0] * 20 + [1.5] * 30
    active, durations = brute_force_spikes(norms, 20, 0.1)
    det = SpikeDetector(20, 0.1)
    assert [bool(det.update(n).get("spike/active")) for n in norms] == active
    assert det.histogram() == {d: durations.count(d) for d in set(durations)} and durations == [16]


def test_agrees_with_brute_force_on_a_random_walk() -> None:
    import random

    rng = random.Random(0)
    norms = [abs(1 + 0.3 * rng.gauss(0, 1)) + (2 if rng.random() < 0.05 else 0) for _ in range(2000)]
    for window, threshold in ((20, 0.1), (5, 0.5), (1, 0.0)):
        active, durations = brute_force_spikes(norms, window, threshold)
        det = SpikeDetector(window, threshold)
        assert [bool(det.update(n).get("spike/active")) for n in norms] == active
        assert det.histogram() == {d: durations.count(d) for d in sorted(set(durations))}
        assert det.count == len(durations) > 10


def test_nan_counts_as_a_spike_and_stays_out_of_the_mean() -> None:
    det = SpikeDetector(3, 0.1)
    for n in (1.0, 1.0, 1.0):
        det.update(n)
    assert det.update(float("nan"))["spike/active"] == 1.0
    assert det.update(1.0)["spike/limit"] == pytest.approx(1.1)  # the NaN did not enter the mean


def test_state_dict_round_trip_continues_identically() -> None:
    norms = [1.0 + (i % 7 == 0) * 0.5 for i in range(60)]
    full = SpikeDetector(5, 0.1)
    rows = [full.update(n) for n in norms]
    first = SpikeDetector(5, 0.1)
    for n in norms[:33]:
        first.update(n)
    resumed = SpikeDetector(5, 0.1)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.update(n) for n in norms[33:]] == rows[33:]
    assert resumed.summary() == full.summary()


def test_flops_per_token_of_the_7b_model_by_hand() -> None:
    from omegaconf import OmegaConf

    m = OmegaConf.to_object(compose_cfg("model=7b")).model
    n = count_params(m)
    assert n == 6_738_415_616
    embedding = 32_000 * 4096
    # 6 (N - embedding) + 12 L H Q T, with L=32, H=32, Q=128, T=4096.
    by_hand = 6 * (6_738_415_616 - 131_072_000) + 12 * 32 * 32 * 128 * 4096
    assert by_hand == 46_086_512_640
    assert flops_per_token(n, embedding, m.n_layers, m.n_heads, m.head_dim, 4096) == by_hand
    assert flops_per_token(n, embedding, m.n_layers, m.n_heads, m.head_dim, 4096, causal=True) == (
        6 * 6_607_343_616 + 6 * 32 * 32 * 128 * 4096
    )


def test_mfu_and_cost_per_4m_tokens_of_hlat_7b() -> None:
    # HLAT-7B: 64 trn1.32xlarge nodes x 32 NeuronCores x 95 TFLOPS, $21.50 per node-hour.
    t = Throughput(
        flops_per_token=46_086_512_640,
        flops_per_token_causal=42_865_287_168,
        peak_flops=64 * 32 * 95e12,
        cost_per_hour=64 * 21.50,
    )
    m = t.metrics(tokens_per_s=1_240_000)
    assert m["perf/mfu"] == pytest.approx(1_240_000 * 46_086_512_640 / (64 * 32 * 95e12))
    assert m["perf/mfu"] == pytest.approx(0.2937, abs=1e-4)
    assert m["perf/mfu_causal"] == pytest.approx(0.2732, abs=1e-4)
    assert m["perf/cost_per_4m_tokens"] == pytest.approx(64 * 21.50 * (4e6 / 1_240_000) / 3600)
    assert m["perf/model_tflops"] == pytest.approx(1_240_000 * 46_086_512_640 / 1e12)
    assert Throughput(1.0, 1.0, None, None).metrics(10.0).keys() == {"perf/model_tflops"}


def test_peak_resolution_order(tmp_path, monkeypatch) -> None:
    assert resolve_peak_flops(ClusterConfig(peak_tflops=2.5), "bfloat16", str(tmp_path)) == (
        2.5e12,
        "cluster.peak_tflops",
    )
    peak, why = resolve_peak_flops(ClusterConfig(backend="neuron"), "bfloat16", str(tmp_path))
    assert peak == 95e12 and "trn1" in why
    peak, why = resolve_peak_flops(ClusterConfig(), "bfloat16", str(tmp_path))  # nothing cached in tmp_path
    assert peak is None and "hlat bench peak" in why
    monkeypatch.setattr("hlat.plan.peak.cached_peak", lambda dtype, cache_dir: 3.0e11 if dtype == "bfloat16" else None)
    assert resolve_peak_flops(ClusterConfig(), "bfloat16", str(tmp_path))[0] == 3.0e11
    assert math.isclose(resolve_peak_flops(ClusterConfig(peak_tflops=0.3), "float32", "")[0], 3e11)


def test_uptime_across_a_simulated_restart() -> None:
    from hlat.track.metrics import Uptime

    job = Uptime(start=1000.0)
    job.add_productive(50.0)  # steps 1-50, checkpoint at t=1060 (10 s of start-up before the first step)
    saved = job.state_dict()
    job.add_productive(30.0)  # steps 51-80 done, then the process dies at t=1100; those 30 s are lost
    m = job.metrics(now=1100.0)
    assert (m["uptime/wall_s"], m["uptime/productive_s"], m["uptime/restarts"]) == (100.0, 80.0, 0.0)
    # Restarted at t=1130 from the checkpoint: 30 s down, 30 s of redone work ahead, 5 s start-up again.
    job = Uptime.resumed(saved)
    job.add_productive(30.0)  # steps 51-80 again, now for good: t=1165
    m = job.metrics(now=1165.0)
    assert m["uptime/restarts"] == 1.0 and m["uptime/wall_s"] == 165.0
    assert m["uptime/productive_s"] == 80.0 and m["uptime/lost_s"] == 85.0
    assert m["uptime/pct"] == pytest.approx(100 * 80 / 165)
