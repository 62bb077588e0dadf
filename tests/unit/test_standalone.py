"""The repository stands alone: no file in it points at a file outside it or at a path of one machine.

Facts from the HLAT paper cite arXiv 2404.10630 (section, table); Neuron facts cite NxD's public code or the Neuron SDK
documentation. A pointer to notes kept beside a checkout (a notes file by name, a folder next to the checkout, a
section of "the reference") or to a development machine's directories cannot be followed by anyone who clones hlat.
Container paths (/opt/hlat) and scratch examples (/tmp/..., /var/tmp/...) are fine: they mean the same everywhere.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTES = ("PAPER", "DESIGN", "neuron-nxd", "nxd-on-xla-cpu", "style-anchors", "peer-platforms", "environment")
# Each pattern is built from pieces, so that this file does not match itself.
FORBIDDEN = {
    "a notes file that is not in the repository": re.compile(r"\b(?:" + "|".join(NOTES) + r")\.md\b"),
    "a folder beside the checkout": re.compile(r"\.\./" + "shared" + r"\b|\b" + "shared" + "/(?:reference|vendor)"),
    "a section of notes that are not in the repository": re.compile(r"\b" + "reference" + " §"),
    "a path of one machine": re.compile(r"(?<![\w.$})])/(?:" + "work|root|home|Users" + ")/"),
}


def repository_files() -> list[str]:
    """Tracked files and new ones git does not ignore: what a clone, or the next commit, would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode().strip()}")
    return sorted(filter(None, listed.stdout.decode().split("\0")))


def outside_references(name: str, text: str) -> list[str]:
    """``file:line: what (the matched text)`` for every forbidden pointer in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            hits += [f"{name}:{number}: {what} ({m.group(0)!r})" for m in pattern.finditer(line)]
    return hits


def test_no_file_points_outside_the_repository() -> None:
    hits = []
    for name in repository_files():
        path = ROOT / name
        data = path.read_bytes() if path.is_file() else b""
        if b"\0" not in data:  # text files only
            hits += outside_references(name, data.decode("utf-8", errors="replace"))
    assert not hits, "cite the paper (arXiv 2404.10630, section) or public docs instead:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line",
    [
        "the paper's facts (" + "PAPER" + ".md, 'Precision')",
        "see `" + "DESIGN" + ".md` of the notes",
        "NxD from .." + "/shared" + "/vendor/neuronx-distributed-2.28.0.tar.gz",
        "values from " + "shared" + "/reference/" + "neuron-nxd" + ".md",
        "the process group exists: reference" + " §1.2",
        "Sources: /" + "work/shared/notes.md",
        "cd /" + "home/alice/hlat",
        "python /" + "root/hlat/train.py",
        "open ~/" + "work/hlat",
    ],
)
def test_each_kind_of_outside_pointer_is_caught(line: str) -> None:
    assert outside_references("f", line), line


@pytest.mark.parametrize(
    "line",
    [
        "WORKDIR /opt/hlat",
        'workdir="$tmp/root/opt/hlat"',
        "compile_cache: /var/tmp/neuron-compile-cache",
        "hlat compare --out /tmp/cmp",
        "https://example.com/" + "work" + "/hlat and docs/trn1.md",  # in pieces: no machine path in this file
        "the shared FSx; arXiv 2404.10630 §4.3; NxD's trainer.py",
    ],
)
def test_paths_that_mean_the_same_everywhere_pass(line: str) -> None:
    assert not outside_references("f", line), line
