"""What a run directory records so a result can be traced: git state, versions, environment."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "hlat",
    "torch",
    "hydra-core",
    "omegaconf",
    "mlflow",
    "pyarrow",
    "sentencepiece",
    "torch-neuronx",
    "neuronx-distributed",
    "torch-xla",
)


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_state(path: Path) -> dict[str, str]:
    """SHA, dirty flag and uncommitted diff of the git checkout holding ``path`` (empty if none)."""
    sha = _git("rev-parse", "HEAD", cwd=path)
    if sha is None:
        return {}
    diff = _git("diff", "HEAD", cwd=path) or ""
    return {"sha": sha.strip(), "dirty": str(bool(diff.strip())).lower(), "diff": diff}


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide a run's numbers (absent ones are skipped)."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def runtime_env() -> dict[str, str]:
    """The ``NEURON_*`` and ``XLA_*`` variables that change compilation and numerics on Trainium."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NEURON_", "XLA_"))}


def write_provenance(run_dir: Path, resolved_yaml: str) -> tuple[dict[str, str], list[Path]]:
    """Write config.yaml, provenance.json and (if dirty) git.diff into ``run_dir``.

    Returns:
        MLflow tags (git SHA, dirty flag, versions) and the files to attach as artifacts.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    git = git_state(Path(__file__).resolve().parent)
    files = [run_dir / "config.yaml", run_dir / "provenance.json"]
    files[0].write_text(resolved_yaml)
    record = {
        "git": {k: v for k, v in git.items() if k != "diff"},
        "packages": package_versions(),
        "env": runtime_env(),
    }
    files[1].write_text(json.dumps(record, indent=2))
    if git.get("diff"):
        files.append(run_dir / "git.diff")
        files[-1].write_text(git["diff"])
    tags = {f"version.{k}": v for k, v in record["packages"].items()}
    if git:
        tags.update({"mlflow.source.git.commit": git["sha"], "git.dirty": git["dirty"]})
    return tags, files
