"""Where the NxD lane gets NeuronX Distributed (tests/neuron/setup_venv.sh): the Neuron pip repository by default,
a local copy with NXD_SOURCE, and a one-line error that names both ways when the chosen one is not there.

The script runs for real: ``--print-source`` stops it before it builds anything, and the download failure runs it up
to the download against an empty local index, so nothing leaves the machine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.timeouts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "neuron" / "setup_venv.sh"
NXD_REQ = "neuronx-distributed==0.17.26814"  # NxD 0.17 as Neuron SDK 2.28 ships it (the SDK's package list)
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"


def run(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script with the caller's environment minus pip's settings and NxD's variables, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NXD_", "NEURON_VENV"))}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=hang_guard(300),
    )


def test_by_default_nxd_comes_from_the_neuron_pip_repository(tmp_path: Path) -> None:
    out = run(tmp_path, "--print-source")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{NXD_REQ} --extra-index-url {NEURON_INDEX}"


@pytest.mark.parametrize("name", ["NXD_SOURCE", "NXD_TARBALL"])
def test_a_local_copy_replaces_the_download(tmp_path: Path, name: str) -> None:
    (tmp_path / "nxd.tar.gz").write_bytes(b"")
    out = run(tmp_path, "--print-source", **{name: "nxd.tar.gz"})  # relative to the caller, not to the repository
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "nxd.tar.gz")


def test_nxd_source_wins_over_its_old_name(tmp_path: Path) -> None:
    for name in ("new.whl", "old.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    out = run(tmp_path, "--print-source", NXD_SOURCE="new.whl", NXD_TARBALL="old.tar.gz")
    assert out.stdout.strip() == str(tmp_path / "new.whl")


def test_a_missing_local_copy_fails_at_once_naming_both_ways(tmp_path: Path) -> None:
    out = run(tmp_path, NXD_SOURCE="nowhere/nxd.tar.gz", NEURON_VENV=str(tmp_path / "venv"))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1, out.stderr
    assert "NXD_SOURCE=nowhere/nxd.tar.gz not found" in out.stderr
    assert f"{NXD_REQ} from the Neuron pip repository ({NEURON_INDEX})" in out.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.slow
def test_an_unreachable_repository_fails_before_anything_is_installed(tmp_path: Path) -> None:
    index = tmp_path / "empty-index"  # an index that serves nothing, as an unreachable repository
    index.mkdir()
    venv = tmp_path / "venv"
    out = run(
        tmp_path,
        NXD_INDEX=index.as_uri(),
        PIP_INDEX_URL=index.as_uri(),
        PIP_CONFIG_FILE=os.devnull,
        PIP_RETRIES="0",
        NEURON_VENV=str(venv),
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"setup_venv.sh: could not download {NXD_REQ} from the Neuron pip repository ({index.as_uri()})"
    )
    assert "set NXD_SOURCE to NxD 0.17's wheel or sdist" in last
    assert not list(venv.glob("lib/python*/site-packages/torch")) and not (venv / ".key").exists()
