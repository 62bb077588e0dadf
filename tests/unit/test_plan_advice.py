"""The planner's advice names only what the backend and launch path run; ``hlat launch`` refuses what they do not.

One predicate, ``hlat.layouts.check_layout`` (``check_torch_layout``, which the torch backend's ``build_model``
calls, or the neuron checks its ``setup`` calls), decides for the trainer, the advice and the launch alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat import layouts
from hlat.backends.torch import backend as torch_backend
from hlat.cli import main as hlat_main
from hlat.config import ConfigError, RunConfig
from hlat.layouts import check_layout
from hlat.parallel import ParallelDims
from hlat.plan.clusters import can_add_nodes
from hlat.plan.memory import GiB, check_fits, check_world, estimate_memory, planned_budget, suggest_fixes
from hlat.plan.paper import compose
from hlat.plan.report import make_plan

CPU_7B = ("model=7b", "cluster.device_memory_gib=16")  # the user's `python train.py model=7b`, at a fixed budget
CASES = [
    CPU_7B,
    ("model=small", "cluster.device_memory_gib=2.5"),  # cluster=cpu: checkpointing or a smaller micro-batch
    ("model=7b", "cluster=cpu_x2", "cluster.device_memory_gib=64"),  # one host: tp 2, never pp or nodes
    ("model=7b", "cluster=gpu_8x", "cluster.device_memory_gib=40", "train.micro_batch_size=1"),
    # master weights keep fp32_grad_accum: the torch backend refuses tp with dp, so tp=4 (dp 2) is no advice
    (
        "model=7b",
        "cluster=gpu_8x",
        "cluster.device_memory_gib=40",
        "train.micro_batch_size=1",
        "precision=master_weights",
    ),
    ("model=70b", "cluster=p5_1node", "train.micro_batch_size=1", "precision=bf16_sr"),  # a node type: may grow
    ("experiment=hlat_70b", "cluster=trn1_1node", "parallelism=single", "precision=master_weights"),  # neuron: pp ok
]


def trainer_accepts(cfg: RunConfig) -> None:
    """What the trainer checks up to and including the memory check, with its own functions (``run.main``)."""
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    check_world(cfg.cluster, cfg.cluster.world_size)
    check_layout(cfg, dims)  # TorchBackend.build_model / NeuronBackend.setup refuse with exactly this
    _, est = estimate_memory(cfg, dims)
    check_fits(est, planned_budget(cfg.cluster), cfg, dims=dims)


def advice(*overrides: str) -> list:
    cfg = compose(*overrides)
    dims = ParallelDims.build(cfg.parallelism, cfg.cluster.world_size, cfg.model, cfg.train)
    budget = planned_budget(cfg.cluster)
    assert estimate_memory(cfg, dims)[1].total > budget, "each case needs advice"
    return suggest_fixes(cfg, dims, budget)


@pytest.mark.parametrize("base", CASES, ids=lambda c: " ".join(c))
def test_every_suggestion_runs_where_it_is_given(base: tuple[str, ...]) -> None:
    cfg = compose(*base)
    for fix in advice(*base):
        new = compose(*base, *fix.overrides)  # the overrides as a user pastes them
        trainer_accepts(new)
        dims = ParallelDims.build(new.parallelism, new.cluster.world_size, new.model, new.train)
        if new.cluster.backend == "torch":  # independent of check_layout: what the torch backend builds
            assert dims.pp == 1 and dims.tp <= new.model.kv_heads, fix.overrides
        if not can_add_nodes(cfg.cluster):
            assert new.cluster.nodes == cfg.cluster.nodes, fix.overrides


def test_cpu_7b_advice_names_no_pipeline_and_no_nodes_but_a_cluster() -> None:
    cfg = compose(*CPU_7B)
    dims = ParallelDims.build(cfg.parallelism, 1, cfg.model, cfg.train)
    _, est = estimate_memory(cfg, dims)
    assert advice(*CPU_7B) == []
    with pytest.raises(ConfigError) as e:
        check_fits(est, planned_budget(cfg.cluster), cfg, dims=dims)
    msg = str(e.value)
    assert "parallelism.pp" not in msg and "cluster.nodes" not in msg
    assert (
        "No change that cluster=cpu can run (torch backend, one host) is predicted to fit: this needs a cluster" in msg
    )
    hint = msg.split("see `hlat plan ")[1].split("`")[0].split()
    assert hint[:2] == ["model=7b", "cluster=p4d_1node"]  # the smallest preset of known hardware that fits 7B
    planned = make_plan(compose(*hint))  # `hlat plan` with the hint: fits, and the trainer would run it
    assert planned.fits and f"(~{planned.memory.total / GiB:.1f} GiB per device)" in msg
    trainer_accepts(planned.cfg)


def test_hlat_plan_reports_the_cluster_instead_of_would_fit(capsys: pytest.CaptureFixture[str]) -> None:
    from hlat.plan.command import main

    assert main([*CPU_7B]) == 0
    out = capsys.readouterr().out
    assert "would fit:" not in out and "this needs a cluster" in out
    assert "see `hlat plan model=7b cluster=p4d_1node" in out


def hlat(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        hlat_main(list(argv))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=7b", "parallelism.pp=8", "cluster.nodes=8"], "pipeline parallelism (parallelism.pp=8)"),
        (
            [
                "model=tiny",
                "cluster=cpu_x2",
                "cluster.nproc_per_node=8",
                "parallelism.tp=8",
                "train.micro_batch_size=2",
            ],
            "kv-head replication (parallelism.tp=8 > 4 kv heads)",
        ),
        (
            [
                "precision=master_weights",
                "cluster=cpu_x2",
                "cluster.nproc_per_node=4",
                "parallelism.tp=2",
                "train.micro_batch_size=4",
            ],
            "fp32_grad_accum=true with tensor and data parallelism",
        ),
    ],
)
def test_launch_refuses_a_layout_the_torch_backend_does_not_build(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, overrides: list[str], message: str
) -> None:
    code, out, err = hlat(capsys, "launch", "--target", "torchrun", "--out", str(tmp_path / "o"), *overrides)
    assert code == 2 and out == ""
    assert err.startswith("hlat: configuration error: ") and "torch backend" in err and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # nothing rendered


def test_compile_refuses_what_the_neuron_backend_does_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = hlat(
        capsys,
        "compile",
        "cluster=trn1_1node",
        "train.global_batch_size=256",
        "parallelism.tp=2",
        "tracker.layer_grad_norms_every=10",
    )
    assert code == 2 and err.startswith("hlat: configuration error:") and "layer_grad_norms_every=10" in err


def test_a_runnable_layout_still_renders(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = hlat(
        capsys,
        "launch",
        "--target",
        "torchrun",
        "--out",
        str(tmp_path),
        "model=7b",
        "cluster.nodes=8",
        "train.micro_batch_size=2",
    )
    assert code == 0
    script = Path(out.strip()).read_text()
    assert "--nnodes 8" in script and "(tp 1, pp 1, dp 8)" in script


def test_trainer_advice_and_launch_share_one_predicate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hlat.layouts.check_torch_layout`` is what build_model, the advice and hlat launch all ask."""
    cfg = compose("model=tiny")
    with pytest.raises(ConfigError, match=r"pipeline parallelism \(parallelism.pp=2\)"):  # before materializing
        torch_backend.TorchBackend(cfg).build_model(ParallelDims(world_size=2, tp=1, pp=2, dp=1))

    def refuse(dims: ParallelDims, *_: object) -> None:
        raise ConfigError(f"refused tp={dims.tp}")

    monkeypatch.setattr(layouts, "check_torch_layout", refuse)
    with pytest.raises(ConfigError, match="refused tp=1"):
        torch_backend.TorchBackend(cfg).build_model(ParallelDims(world_size=1, tp=1, pp=1, dp=1))
    assert advice("model=small", "cluster.device_memory_gib=2.5") == []  # fits with full checkpointing otherwise
    code, _, err = hlat(capsys, "launch", "--target", "torchrun", "model=tiny")
    assert code == 2 and "hlat: configuration error: refused tp=1" in err
