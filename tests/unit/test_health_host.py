"""A Trainium node's devices, limits and shared memory (hlat.health.host) against fake /dev trees and limits."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from hlat.cli import doctor
from hlat.health.host import MIN_SHM_BYTES, neuron_host_problems
from tests.conftest import run_config
from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
GOOD_LIMITS = {resource.RLIMIT_NOFILE: (65536, 65536), resource.RLIMIT_MEMLOCK: (-1, -1)}


def fake_dev(root: Path, neuron: int = 16, uverbs: int = 0) -> Path:
    """A /dev with ``neuron`` Neuron device nodes and ``uverbs`` EFA ones (plain files: only names are looked at)."""
    (root / "infiniband").mkdir(parents=True)
    for i in range(neuron):
        (root / f"neuron{i}").touch()
    for i in range(uverbs):
        (root / "infiniband" / f"uverbs{i}").touch()
    return root


def limits(**changed: tuple[int, int]):
    """A ``getrlimit`` with good limits, except ``nofile=`` / ``memlock=``."""
    table = dict(GOOD_LIMITS)
    names = {"nofile": resource.RLIMIT_NOFILE, "memlock": resource.RLIMIT_MEMLOCK}
    table.update({names[k]: v for k, v in changed.items()})
    return lambda which: table[which]


def problems(cluster: str, dev: Path, shm: int = 16 << 30, **changed: tuple[int, int]) -> list[str]:
    cfg = run_config(f"cluster={cluster}")
    return neuron_host_problems(cfg.cluster, dev=dev, getrlimit=limits(**changed), shm_bytes=shm)


def test_a_complete_trn1_node_passes(tmp_path: Path) -> None:
    assert problems("trn1_1node", fake_dev(tmp_path)) == []
    assert problems("trn1_x4", fake_dev(tmp_path / "efa", uverbs=8)) == []


def test_each_missing_neuron_device_is_named_with_the_flags_that_pass_them(tmp_path: Path) -> None:
    [found] = problems("trn1_1node", fake_dev(tmp_path, neuron=3))
    assert (
        "13 of the 16 Neuron devices of a trn1.32xlarge node are missing (neuron3, neuron4, neuron5, ... neuron15)"
        in found
    )
    assert "--device=/dev/neuron0" in found and "--device=/dev/neuron15" in found
    assert "aws.amazon.com/neuron: 16" in found


def test_the_instance_type_sets_the_device_count(tmp_path: Path) -> None:
    cfg = run_config("cluster=trn1_1node", "cluster.instance_type=trn1.2xlarge")
    dev = fake_dev(tmp_path, neuron=1)
    assert neuron_host_problems(cfg.cluster, dev=dev, getrlimit=limits(), shm_bytes=16 << 30) == []


def test_a_multi_node_preset_needs_efa_devices_and_unlimited_locked_memory(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, uverbs=2)
    efa, memlock = problems("trn1_x4", dev, memlock=(8 << 20, 8 << 20))
    assert "2 of the 8 EFA devices" in efa and "--device=/dev/infiniband/uverbs7" in efa
    assert "vpc.amazonaws.com/efa: 8" in efa
    assert "limited to 8 MiB" in memlock and "--ulimit memlock=-1" in memlock
    assert problems("trn1_1node", dev, memlock=(8 << 20, 8 << 20)) == []  # one node: no EFA, no locked memory


def test_few_open_files_and_a_small_shm_are_named_with_their_settings(tmp_path: Path) -> None:
    nofile, shm = problems("trn1_1node", fake_dev(tmp_path), shm=64 << 20, nofile=(1024, 1024))
    assert "open files are limited to 1024" in nofile and "--ulimit nofile=" in nofile
    assert "/dev/shm holds 64 MiB" in shm and "--shm-size=" in shm and "medium: Memory" in shm
    assert problems("trn1_1node", fake_dev(tmp_path / "ok"), shm=MIN_SHM_BYTES) == []


def test_clusters_without_trainium_have_nothing_to_check(tmp_path: Path) -> None:
    empty = fake_dev(tmp_path, neuron=0)
    for cluster in ("cpu", "xla_cpu", "nxd_cpu"):
        assert problems(cluster, empty, shm=0, nofile=(16, 16)) == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_doctor_names_the_missing_devices_and_packages_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not Path("/dev/neuron0").exists()
    assert doctor.main(["cluster=trn1_1node"]) == 1
    err = capsys.readouterr().err
    assert "16 of the 16 Neuron devices" in err and "Neuron packages torch_xla, neuronx_distributed" in err


@pytest.mark.slow  # a train.py subprocess
def test_a_neuron_preset_without_the_packages_fails_before_any_trainer_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "train.py", "cluster=trn1_1node", "tracker=console", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=hang_guard(120),
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "hlat: health check failed: cluster=trn1_1node cannot run on this node" in done.stderr
    assert "Neuron packages torch_xla, neuronx_distributed are not installed" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "elastic").exists()  # no trainer process was started
