"""The Neuron persistent compile cache on disk: audit it, and hand finished entries to a node's local cache safely.

The cache is a directory tree ``<cache>/neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/`` (the Neuron
SDK's persistent-cache docs). An entry holds the graph (``model.hlo_module.pb``), the compiled ``model.neff`` once a
compile succeeded, ``model.log`` when it failed (a failed entry blocks recompiling that graph until it is removed),
and ``*.lock`` while a compile is under way or after one was killed. The HLAT paper keeps the cache on each node's
local disk (a shared one timed out); HLAT's own scripts compiled into a shared cache and copied it to local disk.

:func:`audit` counts entries by state per version directory; :func:`distribute` copies only finished entries of the
pinned compiler version into a node's cache, each one atomically (a temporary directory renamed into place), and
skips failed, locked and empty entries and those already there. What exactly libneuronxla writes has not been
checked on trn1 (docs/trn1.md, open questions): the states are read from the files above.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

VERSION_PREFIX = "neuronxcc-"
MODULE_PREFIX = "MODULE_"
DONE, FAILED, LOCKED, EMPTY = "done", "failed", "locked", "empty"
STATES = (DONE, FAILED, LOCKED, EMPTY)


def state(entry: Path) -> str:
    """An entry's state: ``locked``, ``done``, ``failed`` or ``empty``.

    ``locked``: a ``*.lock``; ``done``: a non-empty ``model.neff``; ``failed``: a ``*.log`` without a NEFF; ``empty``:
    the graph only (extracted, never compiled).
    """
    names = {p.name for p in entry.iterdir()}
    if any(n.endswith(".lock") for n in names):
        return LOCKED
    neff = entry / "model.neff"
    if neff.is_file() and neff.stat().st_size > 0:
        return DONE
    if any(n.endswith(".log") for n in names):
        return FAILED
    return EMPTY


def matches(version_dir: str, version: str | None) -> bool:
    """Whether ``neuronxcc-<v>`` is the pinned compiler ``version`` (``2.23.6484.0`` matches ``...+3b612583``)."""
    if version is None:
        return True
    found = version_dir.removeprefix(VERSION_PREFIX)
    return found == version or found.split("+")[0] == version.split("+")[0]


@dataclass
class VersionAudit:
    """One ``neuronxcc-*`` directory."""

    name: str
    matches: bool
    states: Counter = field(default_factory=Counter)
    bytes: int = 0


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def audit(cache: Path, version: str | None) -> list[VersionAudit]:
    """Every ``neuronxcc-*`` directory of ``cache``: its entries by state, its size, whether it is the pinned one."""
    out = []
    for vdir in sorted(p for p in Path(cache).iterdir() if p.is_dir() and p.name.startswith(VERSION_PREFIX)):
        a = VersionAudit(vdir.name, matches(vdir.name, version))
        for entry in vdir.iterdir():
            if entry.is_dir() and entry.name.startswith(MODULE_PREFIX):
                a.states[state(entry)] += 1
        a.bytes = _size(vdir)
        out.append(a)
    return out


def audit_text(cache: Path, version: str | None) -> str:
    """``hlat compile --audit``: a table of the version directories, and what does not match the pinned version."""
    found = audit(cache, version)
    if not found:
        return f"{cache}: no {VERSION_PREFIX}* directory (an empty cache, or not a Neuron compile cache)"
    lines = [f"{'version directory':40s} " + " ".join(f"{s:>7s}" for s in STATES) + "      size  pinned"]
    for a in found:
        pin = "yes" if version is None or a.matches else "NO"
        counts = " ".join(f"{a.states[s]:7d}" for s in STATES)
        lines.append(f"{a.name:40s} {counts} {a.bytes / 2**20:8.1f}M  {pin}")
    stale = [a.name for a in found if not a.matches]
    if stale:
        lines.append(f"not the pinned compiler ({version}): {', '.join(stale)}: a run of this image never reads them")
    bad = sum(a.states[FAILED] for a in found if a.matches)
    if bad:
        lines.append(f"{bad} failed entries block recompiling their graphs: remove them (or compile with "
                     "--retry_failed_compilation) before the run")  # fmt: skip
    return "\n".join(lines)


@dataclass
class Distributed:
    """What :func:`distribute` did."""

    copied: int = 0
    present: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Entries not copied, by state (failed, locked, empty)."""


def distribute(source: Path, target: Path, version: str) -> Distributed:
    """Copy every finished entry of ``source/neuronxcc-<version>`` into ``target`` (a node's local cache).

    Each entry is copied into a temporary directory beside its place and renamed into it, so a reader (a run already
    starting) never sees half an entry; an entry already in ``target`` is left alone.

    Raises:
        FileNotFoundError: ``source`` has no directory of that compiler version.
    """
    vdirs = [p for p in Path(source).iterdir() if p.is_dir() and p.name.startswith(VERSION_PREFIX)]
    chosen = [p for p in vdirs if matches(p.name, version)]
    if not chosen:
        have = ", ".join(sorted(p.name for p in vdirs)) or "none"
        raise FileNotFoundError(f"{source} holds no {VERSION_PREFIX}{version} directory (it has: {have})")
    out = Distributed()
    for vdir in chosen:
        dest_dir = Path(target) / vdir.name
        dest_dir.mkdir(parents=True, exist_ok=True)
        for entry in sorted(p for p in vdir.iterdir() if p.is_dir() and p.name.startswith(MODULE_PREFIX)):
            st = state(entry)
            if st != DONE:
                out.skipped[st] += 1
                continue
            final = dest_dir / entry.name
            if final.exists():
                out.present += 1
                continue
            tmp = dest_dir / f".{entry.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(entry, tmp, ignore=shutil.ignore_patterns("*.lock"))
            try:
                os.rename(tmp, final)
            except OSError:  # another copier won the race: its entry is the same graph
                shutil.rmtree(tmp, ignore_errors=True)
                out.present += 1
                continue
            out.copied += 1
    return out
