"""Small generated sources for the mixture tests, each written in an alphabet of its own.

A window's source is then known from its text alone (the letters it holds), not from hlat's labels; every document
starts with its id spelled in its source's letters (``aa<id>aa``), so the documents a window holds are known too.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

ALPHABETS = {"a": "abcdefgh", "b": "ijklmnop", "c": "qrstuvwx", "d": "yzABCDEF"}
"""Each source's letters (8 each: a document id is written in base 8)."""
SHAPES = {"a": (400, 8), "b": (100, 150), "c": (40, 12), "d": (60, 10)}
"""Documents and words per document of each source: ~30, ~600, ~50 and ~40 tokens each."""


def spell(alphabet: str, n: int) -> str:
    """``n`` in base 8 with ``alphabet``'s letters (lowest digit first)."""
    digits = max(1, (n.bit_length() + 2) // 3)
    return "".join(alphabet[(n >> (3 * i)) & 7] for i in range(digits))


def write_source(root: Path, name: str, docs: int | None = None, words: int | None = None) -> Path:
    """``<root>/<name>.jsonl``: ``docs`` documents of ``words`` random words in source ``name``'s alphabet."""
    n, length = SHAPES[name]
    n, length = docs or n, words or length
    rng, alphabet = random.Random(name), ALPHABETS[name]
    rows = []
    for i in range(n):
        marker = alphabet[0] * 2
        body = ["".join(rng.choice(alphabet[1:]) for _ in range(rng.randint(2, 6))) for _ in range(length)]
        rows.append(json.dumps({"text": " ".join([f"{marker}{spell(alphabet, i)}{marker}", *body])}))
    path = root / f"{name}.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def source_of(text: str) -> str | None:
    """The one source whose alphabet holds every letter of ``text``; None if there is none or more than one."""
    letters = set(text) - set(" \n")
    found = [n for n, a in ALPHABETS.items() if letters and letters <= set(a)]
    return found[0] if len(found) == 1 else None


def document_ids(text: str, name: str) -> list[int]:
    """The ids of the documents that start in ``text`` (a decoded stream of source ``name``)."""
    a = ALPHABETS[name]
    marker = re.escape(a[0] * 2)
    ids = []
    for digits in re.findall(f"{marker}([{re.escape(a)}]+?){marker}", text):
        ids.append(sum(a.index(ch) << (3 * i) for i, ch in enumerate(digits)))
    return ids
