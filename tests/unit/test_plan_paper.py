"""The planner against the HLAT paper and the Neuron SDK (hlat.plan.paper; the table of docs/planner.md).

Tolerance: the published figures are themselves reproducible only to about 9%: the SDK's throughput for the very
same config (Llama2-7B, 16 trn1 nodes, TP8 DP64) is 92.9 seq/s in SDK 2.18 and 101.3 in SDK 2.20. A prediction is
accepted when its relative error is within that spread (``TOL``, computed from the two figures, not chosen); the
calibration points themselves must be reproduced to the rounding of the preset values.
"""

from __future__ import annotations

import pytest

from hlat.config import ConfigError
from hlat.plan.memory import GiB, with_changes
from hlat.plan.paper import (
    CALIBRATION,
    PAPER_7B_32,
    PAPER_7B_64,
    PAPER_CPT_RATIO,
    PAPER_SCALING,
    SDK_7B_16,
    SDK_7B_16_OLD,
    SDK_70B_32,
    SDK_70B_32_NEW,
    compose,
    config_of,
    cpt_ratio,
    fit_trn1,
    gpu_baseline,
    predicted,
)
from hlat.plan.report import make_plan

TOL = SDK_7B_16.seq_per_s / SDK_7B_16_OLD.seq_per_s - 1  # 0.090: the SDK's own release-to-release spread


def rel(pred: float, ref: float) -> float:
    return abs(pred / ref - 1)


def test_the_trn1_preset_holds_the_calibrated_values() -> None:
    compute, collective = fit_trn1()
    c = config_of(SDK_7B_16).cluster
    assert c.compute_efficiency == pytest.approx(compute, abs=5e-4)  # the preset rounds to 3 decimals
    assert c.intra_node_efficiency == c.inter_node_efficiency == pytest.approx(collective, abs=5e-4)
    for ref in CALIBRATION:  # so the preset reproduces both points (to the rounding)
        assert rel(*predicted(ref)) < 0.005
    assert 0 < collective < compute < 1  # physical: fractions of peak and of link bandwidth


def test_7b_tp8_pp1_fits_16_gib_neuron_cores() -> None:
    p = make_plan(compose("experiment=hlat_7b"))
    assert (p.dims.tp, p.dims.pp, p.dims.dp) == (8, 1, 256) and p.cfg.cluster.device_memory_gib == 16
    assert p.fits and p.memory.total < 9 * GiB


def test_70b_memory_from_4_to_32_nodes() -> None:
    """Paper: OOM on 4 nodes. Its TP32 x PP8 cannot be placed there; of the two nearest layouts, keeping PP8 is
    predicted out of memory (at the edge) and keeping TP32 is predicted to fit (a disagreement, documented)."""
    big = compose("experiment=hlat_70b")
    with pytest.raises(ConfigError, match=r"world size 128 is not divisible by parallelism\.tp=32 x parallelism\.pp=8"):
        make_plan(with_changes(big, {"cluster.nodes": 4}))  # TP32 x PP8 is 256 NeuronCores: 8 nodes' worth
    keep_pp = make_plan(with_changes(big, {"cluster.nodes": 4, "parallelism.tp": 16}))
    assert not keep_pp.fits  # by 0.01 GiB: at the edge (docs/planner.md)
    keep_tp = make_plan(with_changes(big, {"cluster.nodes": 4}), adapt=True)
    assert (keep_tp.dims.tp, keep_tp.dims.pp) == (32, 4) and "pp 4" in keep_tp.adapted
    assert keep_tp.fits  # the model disagrees with the paper here; the doc says by how much
    for nodes in (8, 16, 32):
        assert make_plan(with_changes(big, {"cluster.nodes": nodes})).fits


def test_predicted_mfu_on_32_nodes() -> None:
    pred, paper = predicted(PAPER_7B_32)
    assert rel(pred, paper) <= TOL, f"predicted MFU {pred:.3f} vs the paper's {paper}"


def test_predicted_scaling_efficiency() -> None:
    base = make_plan(config_of(SDK_7B_16)).step.mfu
    for ref, nodes in ((PAPER_7B_32, 32), (PAPER_7B_64, 64)):
        efficiency = predicted(ref)[0] / base
        assert rel(efficiency, PAPER_SCALING[nodes]) <= TOL, (nodes, efficiency)
    assert predicted(PAPER_7B_64)[0] < predicted(PAPER_7B_32)[0] < base  # MFU falls as the batch is spread thinner


def test_predicted_70b_throughput_lies_in_the_sdks_range() -> None:
    pred, _ = predicted(SDK_70B_32)
    low, high = SDK_70B_32_NEW.seq_per_s, SDK_70B_32.seq_per_s  # 14.3 (SDK 2.20-2.21) .. 17.9 (SDK 2.18)
    assert low * (1 - TOL) <= pred <= high * (1 + TOL), pred


def test_cpt_against_the_gpu_baseline() -> None:
    trn = make_plan(config_of(PAPER_7B_64)).step
    gpu = gpu_baseline().step
    ratio = cpt_ratio()
    # CPT = price / throughput: the ratio is the price-per-peak ratio times the MFU ratio (0.539 x MFU_gpu/MFU_trn)
    trn_c, gpu_c = config_of(PAPER_7B_64).cluster, compose("cluster=p4d_x64").cluster
    per_peak = (trn_c.price_per_hour / (trn_c.peak_tflops * 32)) / (gpu_c.price_per_hour / (gpu_c.peak_tflops * 8))
    assert per_peak == pytest.approx(0.5387, abs=1e-4)
    assert ratio == pytest.approx(per_peak * gpu.mfu / trn.mfu)
    assert ratio < 1  # the paper's finding: Trainium is cheaper per token
    # The GPU network efficiency is assumed, not calibrated: the paper's 54% must lie inside what its range allows.
    assert cpt_ratio(0.2) < PAPER_CPT_RATIO < cpt_ratio(1.0)
