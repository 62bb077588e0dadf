"""Graph fingerprints that are stable across processes: torch-xla's per-sync HLO dump, parsed and canonicalized.

torch-xla writes every graph it runs to ``XLA_SAVE_TENSORS_FILE`` when ``XLA_SAVE_TENSORS_FMT=hlo``: a header naming
the sync, the Python frames that caused it, the graph's HLO text between ``## BEGIN_GRAPH`` and ``## END_GRAPH``, and
torch-xla's own ``Graph Hash``. The HLO text carries instruction and computation names numbered per builder
(``%add.18``, ``IrToHlo.253``) and, with ``XLA_HLO_DEBUG``, metadata with file names and lines. :func:`canonical`
renumbers every name by first appearance and drops the module name, metadata, frontend attributes and comments, as
optimum-neuron's cache canonicalizer does (github.com/huggingface/optimum-neuron, ``optimum/neuron/cache``), so the
same graph traced in another process, after other graphs, gives the same :func:`fingerprint`.

Pure text processing: imports nothing of hlat, torch or torch-xla.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

BEGIN, END = "## BEGIN_GRAPH", "## END_GRAPH"
_HEADER = re.compile(r"^\[(\w+)\]\s*$", re.M)
_HASH = re.compile(r"^Graph Hash: *([0-9a-fA-F]+)\s*$", re.M)
_NAME = re.compile(r"(?<![\w.\-])(%?)([A-Za-z_][\w\-]*)\.(\d+)\b")
_MODULE = re.compile(r"^HloModule [^,\s]+", re.M)
_COMMENT = re.compile(r"/\*.*?\*/")
_ATTRS = ("metadata={", "frontend_attributes={", "statistics={")
FINGERPRINT_CHARS = 16
"""Hex digits of a fingerprint (64 bits: no collision among the few dozen graphs of a sweep)."""


@dataclass(frozen=True)
class DumpedGraph:
    """One graph torch-xla ran, as its dump file shows it."""

    kind: str
    """The dump's header (``ScheduleSyncTensorsGraph``: a sync)."""
    fingerprint: str
    """:func:`fingerprint` of its canonical HLO."""
    raw_hash: str
    """torch-xla's ``Graph Hash`` (its in-process cache key; not comparable across torch-xla builds or devices)."""
    frames: tuple[str, ...]
    """The Python frames that caused the sync, innermost first (``function (file:line)``)."""
    hlo: str
    """The canonical HLO text."""


def _drop_braced(text: str, opener: str) -> str:
    """``text`` without every ``, <opener>...}`` attribute (braces balanced, strings not quoted in HLO attributes)."""
    out, i = [], 0
    while (j := text.find(opener, i)) >= 0:
        start = j
        while start > 0 and text[start - 1] in ", ":  # the separator before the attribute goes too
            start -= 1
        out.append(text[i:start])
        depth, k = 0, j + len(opener) - 1
        while k < len(text):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        i = k
    out.append(text[i:])
    return "".join(out)


def canonical(hlo: str) -> str:
    """``hlo`` (HLO text) with names renumbered by first appearance and metadata, module name and comments dropped.

    ``%add.18`` and ``x.16`` become ``%add.<n>`` and ``x.<n>``, ``n`` counting distinct names in order of appearance:
    the op kinds stay readable, the builder's counters go.
    """
    text = _MODULE.sub("HloModule m", hlo)
    for opener in _ATTRS:
        text = _drop_braced(text, opener)
    text = _COMMENT.sub("", text)
    names: dict[str, int] = {}

    def rename(m: re.Match[str]) -> str:
        key = f"{m.group(2)}.{m.group(3)}"
        n = names.setdefault(key, len(names))
        return f"{m.group(1)}{m.group(2)}.{n}"

    text = _NAME.sub(rename, text)
    lines = (line.rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def fingerprint(hlo: str) -> str:
    """A short, process-independent hash of ``hlo``'s :func:`canonical` form."""
    return hashlib.sha256(canonical(hlo).encode()).hexdigest()[:FINGERPRINT_CHARS]


def parse_dump(text: str) -> tuple[list[DumpedGraph], int]:
    """The complete graphs in ``text`` (a dump file's content from some offset), and how many characters they span.

    A graph still being written (no ``## END_GRAPH`` yet) is left for the next read: the count stops before it.
    """
    graphs, consumed = [], 0
    headers = list(_HEADER.finditer(text))
    for n, head in enumerate(headers):
        stop = headers[n + 1].start() if n + 1 < len(headers) else len(text)
        block = text[head.start() : stop]
        begin, end = block.find(BEGIN), block.find(END)
        if begin < 0 or end < 0:
            break  # incomplete: the writer is still at it
        body = block[begin + len(BEGIN) : end]
        found = _HASH.search(body)
        hlo = body[: found.start()] if found else body
        frames = tuple(
            line.strip()
            for line in block[:begin].splitlines()[1:]
            if line.startswith("  ") and "(" in line and not line.strip().startswith("Root Hashes")
        )
        canon = canonical(hlo)
        graphs.append(
            DumpedGraph(
                kind=head.group(1),
                fingerprint=hashlib.sha256(canon.encode()).hexdigest()[:FINGERPRINT_CHARS],
                raw_hash=found.group(1) if found else "",
                frames=frames,
                hlo=canon,
            )
        )
        consumed = head.start() + end + len(END)
    return graphs, consumed
