"""Cluster presets: world sizes, multi-node guards, and dry runs planned for a cluster this host is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.config import ConfigError, to_run_config
from hlat.launch.elastic import supervise
from hlat.plan.memory import check_world, planned_budget
from hlat.train.run import main
from tests.conftest import CONF, compose_cfg, run_config

GiB = 1024**3


def never_started(*args: object) -> None:
    """The worker of a job that must be refused before any process starts."""
    raise AssertionError("a process started")


@pytest.mark.parametrize(
    ("preset", "backend", "nodes", "world"),
    [
        ("cpu", "torch", 1, 1),
        ("cpu_x2", "torch", 1, 2),
        ("gpu_1x", "torch", 1, 1),
        ("gpu_8x", "torch", 1, 8),
        ("trn1_1node", "neuron", 1, 32),
        ("trn1_x4", "neuron", 4, 128),
        ("trn1_x32", "neuron", 32, 1024),
        ("trn1_x64", "neuron", 64, 2048),
        ("trn1_x256", "neuron", 256, 8192),
        ("p4d_1node", "torch", 1, 8),
        ("p4d_x64", "torch", 64, 512),
        ("p5_1node", "torch", 1, 8),
        ("trn1n_1node", "neuron", 1, 32),
        ("xla_cpu", "neuron", 1, 1),
        ("nxd_cpu", "neuron", 1, 2),
    ],
)
def test_cluster_presets(preset: str, backend: str, nodes: int, world: int) -> None:
    c = to_run_config(compose_cfg(f"cluster={preset}")).cluster
    assert (c.name, c.backend, c.nodes, c.world_size) == (preset, backend, nodes, world)
    if preset.startswith("trn1_"):  # paper §2: 95 TFLOPS and 16 GiB per NeuronCore, $21.50 per trn1.32xlarge-hour
        assert (c.peak_tflops, c.device_memory_gib, c.price_per_hour, c.devices_per_node) == (95.0, 16, 21.5, 32)
        assert c.efa_devices == 8 and c.compile_cache.startswith("/var/tmp")  # local disk, not FSx
        assert c.max_restarts == (3 if nodes > 1 else 0)


def test_every_cluster_file_is_listed() -> None:
    names = sorted(p.stem for p in (CONF / "cluster").glob("*.yaml"))
    assert names == sorted(
        [
            "cpu",
            "cpu_x2",
            "gpu",
            "gpu_1x",
            "gpu_8x",
            "trn1_1node",
            "trn1_x4",
            "trn1_x32",
            "trn1_x64",
            "trn1_x256",
            "trn1n_1node",
            "p4d_1node",
            "p4d_x64",
            "p5_1node",
            "xla_cpu",
            "nxd_cpu",
        ]
    )


@pytest.mark.parametrize(
    ("experiment", "layout"),
    [("hlat_7b", "world 2048 (tp 8, pp 1, dp 256)"), ("hlat_70b", "world 1024 (tp 32, pp 8, dp 4)")],
)
def test_paper_experiments_plan_their_cluster_on_any_host(experiment: str, layout: str, tmp_path: Path, capsys) -> None:
    """A dry run needs neither the Neuron packages nor the nodes: it plans for the preset's world and memory."""
    main(run_config(f"experiment={experiment}", "train.dry_run=true"), run_dir=tmp_path)
    out = capsys.readouterr().out
    assert layout in out and "of 14.4 GiB available" in out  # 16 GiB x memory_fraction 0.9


def test_planned_budget_uses_the_device_memory_of_the_preset() -> None:
    c = to_run_config(compose_cfg("cluster=trn1_1node", "cluster.memory_fraction=0.5")).cluster
    assert planned_budget(c) == 8 * GiB


def test_a_partial_world_is_refused_for_a_multi_node_preset() -> None:
    c = to_run_config(compose_cfg("cluster=trn1_x4")).cluster
    check_world(c, 128)
    with pytest.raises(
        ConfigError,
        match=r"cluster=trn1_x4 plans 4 nodes x 32 processes = 128 ranks, but this job "
        r"has 32; start it on every node as `hlat launch`",
    ):
        check_world(c, 32)
    check_world(to_run_config(compose_cfg("cluster=gpu_1x")).cluster, 8)  # one node: an external torchrun decides


def test_python_train_py_does_not_start_one_node_of_a_multi_node_job(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"spans 32 nodes.*hlat launch --target torchrun\|slurm\|eks"):
        supervise(run_config("cluster=trn1_x32"), tmp_path, never_started)


def test_an_elastic_restart_continues_its_own_checkpoints(tmp_path: Path, monkeypatch) -> None:
    """torchrun / Slurm / a PyTorchJob restart the same command line; the job must not refuse or rewind itself."""
    from hlat.checkpoint import restart_resume

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_resume("never", tmp_path) == "never"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_resume("never", tmp_path) == "auto"
    assert restart_resume("/ckpt/step_100", tmp_path) == "/ckpt/step_100"  # nothing of its own yet
    (tmp_path / "step_4").mkdir()
    (tmp_path / "step_4" / "manifest.json").write_text("{}")
    assert restart_resume("/ckpt/step_100", tmp_path) == "auto"


def test_a_bad_layout_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    cfg = run_config("cluster=trn1_1node")  # the default batch of 16 cannot feed 32 data-parallel ranks
    with pytest.raises(ConfigError, match=r"train.global_batch_size=16 is not divisible .* degree 32"):
        supervise(cfg, tmp_path, never_started)
    assert not (tmp_path / "elastic").exists()


def test_the_neuron_backend_without_the_neuron_packages_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    import importlib.util
    import os

    if importlib.util.find_spec("neuronx_distributed") is not None:
        pytest.skip("the Neuron packages are installed here")
    cfg = run_config("cluster=trn1_1node", "cluster.nproc_per_node=1", "tracker=console")
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the backend exports NEURON_* before importing
    with pytest.raises(ConfigError, match=r"needs torch-neuronx and neuronx-distributed .* not PyPI"):
        main(cfg, run_dir=tmp_path)
