"""What a run directory records so a result can be traced: git state, versions, environment.

:func:`redact_env` is the one place that decides what is a credential, for every file hlat writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
from collections.abc import Mapping
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
REDACTED = "<redacted>"
"""What a credential's value is recorded as, so the record still shows that the variable was set."""
SECRET_ENDINGS = ("TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS")
"""Words that mark a credential also at the end of a longer name part (``GITHUBTOKEN``, ``CLIENTSECRET``)."""
_WHOLE = frozenset({"KEY", "KEYS", "APIKEY", "ACCESSKEY", "PRIVATEKEY", "PRIVATE", "PASS", "PWD", "CREDS"})
SECRET_WORDS = _WHOLE | {"AUTH", "OAUTH", "AUTHORIZATION", "SESSION", "COOKIE", *SECRET_ENDINGS}
"""Name parts (split on ``_`` and other non-alphanumerics, case-insensitive) that mark a credential: ``API_KEY`` and
``AWS_ACCESS_KEY_ID`` match ``KEY``, ``MONKEY`` does not (``KEY`` and ``PASS`` end harmless words: ``BYPASS``).
``CERT`` is not one: certificates and their paths are public, and a private key's name says ``KEY`` or ``PRIVATE``."""
NOT_SECRETS = frozenset({"NEURON_TOKEN_GEN_BUCKETS"})
"""Names that match the words above but are Neuron knobs, not credentials (inference's token-generation buckets)."""
_URL_USERINFO = re.compile(r"://[^/?#@\s]+@")
"""The ``user:password@`` of a URL (``https://<token>@host`` too: a user name alone may be a token)."""


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


def is_secret_name(name: str) -> bool:
    """Whether a variable's name looks like a credential's (:data:`SECRET_ENDINGS`, :data:`SECRET_WORDS`)."""
    if name.upper() in NOT_SECRETS:
        return False
    parts = re.split(r"[^A-Z0-9]+", name.upper())
    return any(p in SECRET_WORDS or p.endswith(SECRET_ENDINGS) for p in parts)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as it may be written down: every credential's value, and any URL's ``user:password@``, redacted."""
    return {k: REDACTED if is_secret_name(k) else _URL_USERINFO.sub(f"://{REDACTED}@", v) for k, v in env.items()}


def runtime_env() -> dict[str, str]:
    """The ``NEURON_*`` and ``XLA_*`` variables that change compilation and numerics on Trainium, without secrets."""
    return redact_env({k: v for k, v in sorted(os.environ.items()) if k.startswith(("NEURON_", "XLA_"))})


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
