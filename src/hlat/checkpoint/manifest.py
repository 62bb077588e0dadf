"""Checkpoint manifests: what a complete, intact checkpoint is, and whether a config can load one.

``manifest.json``, written last, records the step, every file's size and sha256, and the config that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from hlat.config import ConfigError, flatten

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def step_dir(root: Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` optimizer steps."""
    return root / f"step_{step:08d}"


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks into one buffer.

    One buffer, not a new ``bytes`` a block: the writers have glibc map every buffer of 1 MiB or more afresh
    (``writer.unmap_freed_tensors``), and faulting in a fresh 1 MiB a block cost a third of the hashing again (0.3 of
    0.9 CPU s per GB here).
    """
    h = hashlib.sha256()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def config_hash(config: dict[str, Any]) -> str:
    """Short, stable hash of a resolved config (sorted JSON)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _shape_problem(meta: Any) -> str | None:
    """Why parsed ``manifest.json`` content is not a manifest hlat wrote (None: it has the right shape).

    A manifest: ``files`` (name -> size or ``{"size", "sha256"}``), optionally an int ``step`` and ``config`` /
    ``model`` objects.
    """
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    files = meta.get("files")
    if not isinstance(files, dict):
        return "has no 'files' object"
    for name, rec in files.items():
        size, digest = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (rec, None)
        if not _is_int(size) or size < 0 or (digest is not None and not isinstance(digest, str)):
            return f"has a malformed entry for {name!r} in 'files'"
    if "step" in meta and not _is_int(meta["step"]):
        return f"has a non-integer 'step' ({meta['step']!r})"
    for key in ("config", "model"):
        if key in meta and not isinstance(meta[key], dict):
            return f"has a non-object '{key}'"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's manifest, or None and why it is missing, unreadable or malformed."""
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"no readable {MANIFEST} (an interrupted save)"
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        return None, f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    why = _shape_problem(meta)
    if why is not None:
        return None, f"{MANIFEST} {why} (damaged, or not written by hlat)"
    return meta, ""


def manifest(path: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has none, or one that is unreadable or of the wrong shape."""
    return _read_manifest(path)[0]


def problems(path: Path, *, checksums: bool = False, part: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (empty: it is complete and, with ``checksums``, intact).

    ``part`` = (k, n): hash only every n-th file from the k-th, in the manifest's order (sizes are checked for all),
    so that n ranks verifying one checkpoint read it once between them (:class:`hlat.checkpoint.verify.Checks`).
    """
    meta, why = _read_manifest(path)
    if meta is None:
        return [why]
    out = []
    k, n = part
    for i, (name, rec) in enumerate(meta["files"].items()):
        checksums_here = checksums and i % n == k
        size, digest = (rec, None) if isinstance(rec, int) else (rec["size"], rec.get("sha256"))
        f = path / name
        if not f.is_file():
            out.append(f"{name} is missing")
        elif f.stat().st_size != size:
            out.append(f"{name} has {f.stat().st_size} bytes, the manifest says {size}")
        elif checksums_here and digest is not None and sha256(f) != digest:
            out.append(f"{name} does not match its sha256")
    return out


SHAPE_KEYS = tuple(f"model.{k}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"))
"""Config keys that decide the shape of the saved weights."""


LAYOUT_KEYS = {
    "parallelism.tp": "the weights are saved sharded by tensor-parallel rank",
    "parallelism.pp": "the layers are saved by pipeline stage",
    "precision.param_dtype": "the weights and optimizer moments are stored in that dtype",
    "train.global_batch_size": (
        "the data stream packs one sequence per slot of the global batch: another size would read other documents "
        "in every slot"
    ),
    "precision.master_weights": (
        "the optimizer state holds or lacks the fp32 master copy: the torch backend starts one from the bf16 "
        "weights (false -> true) but never drops it"
    ),
}
"""Keys whose change the saved state may not survive, and why; :data:`RESHARDED` lists the changes that are loaded."""

_XSER = "hlat rewrites the xser files for this run's layout before NxD loads them (hlat.checkpoint.xser_write)"

RESHARDED: dict[tuple[str, str, Any, Any], str] = {
    ("torch", "parallelism.tp", None, None): "the weights and AdamW state are resharded as they are read",
    ("neuron", "parallelism.tp", None, None): _XSER,
    ("neuron", "parallelism.pp", None, None): _XSER,
    ("torch", "precision.master_weights", False, True): (
        "the fp32 master weights start as the checkpoint's bf16 weights, exactly; its bf16 AdamW moments continue "
        "in fp32"
    ),
}
"""(backend, key, old, new; None: any value) -> what resuming across that change does. Changes of other keys that
only say how the state is spread over the ranks (parallelism.zero1, sequence_parallel, the DP degree) need nothing
here: DCP reads every tensor into whatever layout loads it, and the neuron resume rewrites the files for any layout."""


def _resharding(backend: str, key: str, old: Any, new: Any) -> str | None:
    """What resuming across ``key``: ``old`` -> ``new`` does on ``backend`` (None: it cannot be loaded)."""
    for (b, k, o, n), what in RESHARDED.items():
        if (b, k) == (backend, key) and o in (None, old) and n in (None, new):
            return what
    return None


def check_compatible(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Refuse, before anything is built, to resume a checkpoint whose saved state ``config`` cannot load.

    A change of model shape, or of a layout or storage dtype that :data:`RESHARDED` does not convert, is a
    ConfigError naming each key; other changes are logged.

    Returns:
        Each changed key (but ``train.resume`` and ``fault.*``): ``"old -> new"``, for the run's
        ``restart.changed.<key>`` tags.
    """
    meta = manifest(path) or {}
    if "config" in meta:
        saved, now = flatten(meta["config"]), flatten(config)
    elif "model" in meta:  # written before the whole config was recorded
        saved, now = flatten({"model": meta["model"]}), flatten({"model": config.get("model", {})})
    else:
        return {}
    changed = [k for k in sorted(set(saved) | set(now)) if not k.endswith(".name") and saved.get(k) != now.get(k)]
    diff = {k: f"{k}={saved.get(k)!r} in the checkpoint but {now.get(k)!r} now" for k in changed}
    backend = saved.get("cluster.backend", "torch")
    what = {k: _resharding(backend, k, saved.get(k), now.get(k)) for k in changed if k in LAYOUT_KEYS}
    if now.get("cluster.backend", backend) != backend:  # each backend loads its own files only
        raise ConfigError(
            f"cannot resume {path}: it was written by the {backend} backend and this run is on the "
            f"{now.get('cluster.backend')} backend. Convert it first (hlat convert {path} <new dir> --to "
            f"{now.get('cluster.backend')}) and resume from that (train.resume=<new dir>), or start a new run from its "
            f"weights (train.init_from={path})"
        )
    breaking = [
        diff[k] + (f" ({LAYOUT_KEYS[k]})" if k in LAYOUT_KEYS else "")
        for k in changed
        if k in SHAPE_KEYS or (k in LAYOUT_KEYS and what[k] is None)
    ]
    if breaking:
        raise ConfigError(
            f"cannot resume {path}: {'; '.join(breaking)}. Resume with the checkpoint's settings for these keys, "
            f"start a new run from its weights alone (train.init_from={path}), or start a new run "
            "(train.resume=never with another train.checkpoint_dir)"
        )
    out = {}
    for k in changed:
        if not k.startswith(("train.resume", "fault.")):
            log.info("resuming with a changed setting: %s%s", diff[k], f": {what[k]}" if what.get(k) else "")
            out[k] = f"{saved.get(k)} -> {now.get(k)}"
    return out


def checkpoint_bytes(path: Path | None) -> int | None:
    """Total size of a checkpoint from its manifest (None without one)."""
    meta = manifest(path) if path is not None else None
    return sum(r if isinstance(r, int) else r["size"] for r in meta["files"].values()) if meta else None
