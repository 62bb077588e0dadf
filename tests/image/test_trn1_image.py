"""The trn1 image against its stand-in DLC (the python base + CPU torch), what ``hlat doctor`` says in it with and
without a trn1 host's devices and limits, and builds on bad bases that must fail with the reason.

The stand-in proves the install guards, the entry point and the doctor's view from inside a container; not the
Neuron packages, compilers or devices of the real DLC (those need a trn1 host).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.image.conftest import HERE, ROOT, podman, podman_env
from tests.timeouts import hang_guard

STANDIN = "localhost/hlat-base/dlc:standin"
STACK = ("torch==", "numpy==", "triton==")


def python(image: str, *code: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return podman("run", "--rm", "--network", "none", *flags, "--entrypoint", "python", image, *code)


def freeze(image: str) -> set[str]:
    done = python(image, "-m", "pip", "list", "--format=freeze")
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


def test_installing_hlat_left_the_base_torch_stack_and_pip_check_as_they_were(images: dict[str, str]) -> None:
    before, after = freeze(STANDIN), freeze(images["trn1"])
    stack = {p for p in before if p.lower().startswith(STACK) or "nvidia" in p.lower()}
    assert any(p.startswith("torch==") for p in stack)
    assert stack <= after, f"changed: {sorted(stack - after)}"
    check_before = set(python(STANDIN, "-m", "pip", "check").stdout.splitlines())
    check_after = set(python(images["trn1"], "-m", "pip", "check").stdout.splitlines())
    assert check_after <= check_before | {"No broken requirements found."}, sorted(check_after - check_before)


def test_the_entry_point_plans_the_paper_run_and_there_is_no_healthcheck(images: dict[str, str]) -> None:
    [image] = json.loads(podman("image", "inspect", images["trn1"], check=True).stdout)
    assert image["Config"]["Entrypoint"] == ["python", "train.py"]
    assert image["Healthcheck"]["Test"] == ["NONE"]  # kept: the image is in docker format
    done = podman("run", "--rm", "--network", "none", images["trn1"], "experiment=hlat_7b", "train.dry_run=true")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "world 2048 (tp 8, pp 1, dp 256)" in done.stdout  # the paper's 7B run: 64 trn1 nodes


def doctor(image: str, *flags: str, cluster: str = "trn1_1node") -> tuple[int, str]:
    command = ("run", "--rm", "--network", "none", *flags, "--entrypoint", "hlat", image, "doctor")
    done = podman(*command, f"cluster={cluster}")
    return done.returncode, done.stdout + done.stderr


def test_doctor_in_the_container_names_each_missing_device_and_limit_with_its_fix(images: dict[str, str]) -> None:
    code, out = doctor(images["trn1"])  # podman's defaults: no device, a 64 MiB /dev/shm
    assert code == 1, out[-4000:]
    assert "16 of the 16 Neuron devices of a trn1.32xlarge node are missing" in out and "--device=/dev/neuron15" in out
    assert "/dev/shm holds 62.5 MiB (at least 1 GiB needed)" in out and "--shm-size=" in out  # podman's 64m
    assert "Neuron packages torch_xla, neuronx_distributed are not installed" in out  # the stand-in has none
    assert "Traceback" not in out

    granted = [f"--device=/dev/null:/dev/neuron{i}" for i in range(16)] + ["--shm-size=2g"]
    code, out = doctor(images["trn1"], *granted)
    assert code == 1 and "Neuron devices" not in out and "/dev/shm" not in out, out[-4000:]
    code, out = doctor(images["trn1"], *granted[1:])
    assert "1 of the 16 Neuron devices of a trn1.32xlarge node are missing (neuron0)" in out, out[-4000:]

    # A --ulimit replaces containers.conf's default_ulimits: nproc must be given again (this VM cannot raise it).
    low = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=32768:32768")
    code, out = doctor(images["trn1"], *granted, *low, cluster="trn1_x4")
    assert code == 1, out[-4000:]
    assert "open files are limited to 1024" in out and "--ulimit nofile=" in out
    assert "0 of the 8 EFA devices" in out and "--device=/dev/infiniband/uverbs7" in out
    assert "--ulimit memlock=-1" in out  # this VM cannot grant unlimited locked memory: always named here


def build_on(base: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """The trn1 target built FROM ``base`` (the lane's build mounts); its output."""
    pip_conf = tmp / "pip.conf"
    pip_conf.write_text("[global]\ncert = /run/hlat-host-ca.crt\n")
    name, tag = base.rsplit(":", 1)
    mounts = ["-v", "/etc/ssl/certs/ca-certificates.crt:/run/hlat-host-ca.crt:ro", "-v", f"{pip_conf}:/etc/pip.conf:ro"]
    args = ["--build-arg", f"NEURON_DLC_IMAGE={name}", "--build-arg", f"NEURON_DLC_TAG={tag}", "-t", "hlat:bad-base"]
    command = [
        "podman",
        "build",
        "--network",
        "host",
        "--format",
        "docker",
        "--target",
        "trn1",
        *mounts,
        *args,
        str(ROOT),
    ]
    return subprocess.run(command, env=podman_env(), capture_output=True, text=True, timeout=hang_guard(900))


def test_a_base_without_torch_or_with_a_torch_hlat_would_replace_fails_the_build(
    images: dict[str, str], tmp_path: Path
) -> None:
    done = build_on("localhost/hlat-base/python:3.11", tmp_path)
    assert done.returncode != 0
    assert "no torch in the base image: not a PyTorch DLC" in done.stderr, done.stderr[-4000:]

    old = "localhost/hlat-base/dlc:torch2.0"
    podman("build", "-t", old, "-f", str(HERE / "old-torch.Containerfile"), str(HERE), timeout=600, check=True)
    done = build_on(old, tmp_path)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "torch==2.0.0" in out and "ResolutionImpossible" in out, out[-4000:]
    assert podman("image", "exists", "hlat:bad-base").returncode != 0
