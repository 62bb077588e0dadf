"""Verifying a checkpoint's sha256s across ranks: each file hashed by one rank, the same verdict on every rank."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest

from hlat import checkpoint
from tests.unit.test_health_dist import join, run_two

manifest_module = importlib.import_module("hlat.checkpoint.manifest")  # the package re-exports a function `manifest`

FILES = [f"shard_{i}.bin" for i in range(5)]
DAMAGED = FILES[3]  # hashed by rank 1 of 2 (every other file from the second): rank 0 alone would miss it


def make_checkpoint(root: Path, step: int, damage: str | None = None) -> Path:
    """A step directory of FILES with a manifest of their sizes and sha256s; ``damage``'s byte flipped afterwards."""
    path = checkpoint.step_dir(root, step)
    path.mkdir(parents=True)
    files = {}
    for i, name in enumerate(FILES):
        data = bytes([step, i]) * 1000
        (path / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / checkpoint.MANIFEST).write_text(json.dumps({"step": step, "files": files}))
    if damage is not None:
        data = bytearray((path / damage).read_bytes())
        data[7] ^= 0xFF  # same size: only the checksum can tell
        (path / damage).write_bytes(bytes(data))
    return path


def counting_sha256(monkeypatch: pytest.MonkeyPatch | None = None) -> list[str]:
    """Record every file hashed through the manifest module (the one place a checkpoint's sha256s are checked)."""
    hashed: list[str] = []
    real = manifest_module.sha256

    def sha256(path: Path) -> str:
        hashed.append(f"{path.parent.name}/{path.name}")
        return real(path)

    if monkeypatch is None:
        manifest_module.sha256 = sha256
    else:
        monkeypatch.setattr(manifest_module, "sha256", sha256)
    return hashed


def test_parts_hash_disjoint_files_that_cover_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    path = make_checkpoint(tmp_path, 1, damage=DAMAGED)
    hashed = counting_sha256(monkeypatch)
    found = [checkpoint.problems(path, checksums=True, part=(k, 2)) for k in range(2)]
    assert found == [[], [f"{DAMAGED} does not match its sha256"]]
    assert sorted(hashed) == sorted(f"{path.name}/{f}" for f in FILES)  # each file once, by one part
    assert checkpoint.Checks().problems(path) == found[1]  # alone: every file


def _verify(rank: int, port: int, root: str) -> None:
    join(rank, port)
    hashed = counting_sha256()
    found = checkpoint.find_resume("auto", Path(root), checkpoint.shared_checks())
    Path(root, f"rank{rank}.json").write_text(json.dumps({"found": str(found), "hashed": hashed}))


def test_the_ranks_of_a_job_read_each_file_once_and_agree(tmp_path: Path) -> None:
    good = make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2, damage=DAMAGED)
    assert run_two(_verify, str(tmp_path)) == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["found"] for r in ranks] == [str(good)] * 2  # rank 0 skips step 2 on what rank 1 found
    hashed = ranks[0]["hashed"] + ranks[1]["hashed"]
    assert sorted(hashed) == sorted(f"step_{s:08d}/{f}" for s in (1, 2) for f in FILES)  # once each, job-wide
    assert f"step_00000002/{DAMAGED}" in ranks[1]["hashed"]
