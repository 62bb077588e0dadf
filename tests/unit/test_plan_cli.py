"""The pre-flight refusal names a fix that fits, and ``hlat plan`` reports memory, step time, MFU and cost."""

from __future__ import annotations

import json
import re

import pytest

from hlat.cli import main as hlat_main
from hlat.config import ConfigError
from hlat.parallel import ParallelDims
from hlat.plan.command import main
from hlat.plan.memory import GiB, check_fits, estimate_memory, planned_budget, suggest_fixes, with_changes
from hlat.plan.paper import compose
from hlat.plan.report import make_plan

# HLAT-7B on one trn1 node without sequence parallelism or checkpointing: ~23 GiB per NeuronCore of 14.4.
TOO_BIG = (
    "experiment=hlat_7b",
    "cluster=trn1_1node",
    "parallelism.sequence_parallel=false",
    "parallelism.activation_checkpointing=none",
)


def fits_with(overrides: tuple[str, ...]) -> bool:
    """Oracle: compose the suggested overrides on top and estimate again."""
    cfg = compose(*TOO_BIG, *overrides)
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    return estimate_memory(cfg, dims)[1].total <= planned_budget(cfg.cluster)


def test_refusal_names_the_cheapest_fixes_that_fit() -> None:
    cfg = compose(*TOO_BIG)
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    _, est = estimate_memory(cfg, dims)
    budget = planned_budget(cfg.cluster)
    assert est.total > budget
    with pytest.raises(ConfigError) as e:
        check_fits(est, budget, cfg, dims=dims)
    msg = str(e.value)
    # sequence parallelism alone is not enough (12.3 GiB of activations); selective checkpointing is the cheapest fix
    fixes = suggest_fixes(cfg, dims, budget)
    assert [f.overrides for f in fixes] == [
        ("parallelism.activation_checkpointing=selective",),
        ("parallelism.activation_checkpointing=full",),
    ]
    assert not fits_with(("parallelism.sequence_parallel=true",))
    for fix in fixes:
        assert fits_with(fix.overrides)
        assert f"`{' '.join(fix.overrides)}` (~{fix.memory.total / GiB:.1f} GiB)" in msg
    assert "model=7b needs about 22.9 GiB per rank" in msg and "estimates" in msg
    with pytest.raises(ConfigError, match="activation_checkpointing=selective"):  # without dims: the cluster's
        check_fits(est, budget, cfg)


def test_structural_fixes_when_no_saver_is_enough() -> None:
    cfg = compose("experiment=hlat_70b", "cluster=trn1_1node", "parallelism=single", "precision=master_weights")
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    fixes = suggest_fixes(cfg, dims, planned_budget(cfg.cluster))
    assert fixes, "a 70B model fits on more nodes with tp, pp, ZeRO-1 and checkpointing"
    for fix in fixes:
        keys = dict(o.split("=") for o in fix.overrides)
        assert int(keys["cluster.nodes"]) > 1 and int(keys["parallelism.tp"]) <= 32  # tp stays within a node
        new = compose(
            "experiment=hlat_70b",
            "cluster=trn1_1node",
            "parallelism=single",
            "precision=master_weights",
            *fix.overrides,
        )
        assert make_plan(new).fits


def test_no_fix_falls_back_to_the_generic_advice() -> None:
    cfg = compose()
    dims = ParallelDims.build(cfg.parallelism, 1, cfg.model, cfg.train)
    _, est = estimate_memory(cfg, dims)
    check_fits(est, est.total, cfg, dims=dims)  # fits exactly: no error
    with pytest.raises(
        ConfigError,
        match=r"this needs a cluster: see `hlat plan model=tiny cluster=p4d_1node[^`]*` .*"
        r"Otherwise: use a smaller model \(model=tiny or model=small\)",
    ):
        check_fits(est, 1, cfg, dims=dims)


def test_hlat_plan_report(capsys) -> None:
    assert main(["experiment=hlat_7b"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(compose("experiment=hlat_7b"))
    assert "layout: tp 8 x pp 1 x dp 256; selective checkpointing, sequence parallel" in out
    assert re.search(rf"total\s+{plan.memory.total / GiB:.2f}\s+fits", out)
    assert f"MFU {100 * plan.step.mfu:.1f}% (as perf/mfu)" in out
    assert f"CPT ${plan.step.cost_per_4m_tokens:,.2f} per 4M tokens" in out
    assert "dp_exposed" in out and "450,000 steps" in out and "$" in out.splitlines()[-1]


def test_hlat_plan_json_and_node_sweep(capsys) -> None:
    assert main(["experiment=hlat_7b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["layout"] == {"tp": 8, "pp": 1, "dp": 256}
    step = data["step"]
    assert step["step_s"] == pytest.approx(sum(step["components_s"].values()))
    assert step["tokens_per_s"] == pytest.approx(1024 * 4096 / step["step_s"])
    assert main(["experiment=hlat_70b", "--nodes", "4,8,32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["nodes"] for r in rows] == [4, 8, 32]
    assert rows[0]["adapted"] and rows[0]["layout"]["pp"] == 4 and not rows[1]["adapted"]
    assert rows[0]["step"]["scaling_efficiency"] == 1.0
    assert rows[2]["step"]["scaling_efficiency"] == pytest.approx(rows[2]["step"]["mfu"] / rows[0]["step"]["mfu"])
    assert main(["experiment=hlat_7b", "--nodes", "16,64"]) == 0
    table = capsys.readouterr().out
    assert "scaling" in table and "100.0%" in table and len(table.splitlines()) == 4


def test_hlat_plan_is_a_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        hlat_main(["plan", "experiment=hlat_70b", "cluster=trn1_x4"])
    assert e.value.code == 0
    assert "NOTE: tp 32 x pp 8 needs 256 ranks per replica and this world has 128" in capsys.readouterr().out
    assert main(["model=nope"]) == 2
    assert "hlat plan:" in capsys.readouterr().err


def test_a_cluster_without_a_step_model_still_plans_memory(capsys) -> None:
    assert main(["model=tiny"]) == 0
    out = capsys.readouterr().out
    assert "memory per device" in out and "step time: not modelled (cluster=cpu has no cluster.peak_tflops" in out
    plan = make_plan(with_changes(compose(), {"cluster.peak_tflops": 1.0}))
    assert plan.step is None and "cluster.intra_node_gb_s" in plan.no_step
