"""Checkpoint policy: where and when to save, atomic step directories, finding the latest valid one.

*How* weights and optimizer state are written is the backend's business (``Backend.save``/``load``:
one file on the torch backend, sharded NxD files on Trainium). This module makes each save atomic: the
backend writes into ``step_XXXXXXXX.tmp/``, then ``manifest.json`` (step, every file's size and sha256, the
model shape) goes in last and the directory is renamed. A directory without a manifest is never loaded, and
one whose files do not match their checksums is skipped with a warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hlat.backends.base import Backend
from hlat.config import ConfigError
from hlat.loop import StepOutput, TrainState

MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def step_dir(root: Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` optimizer steps."""
    return root / f"step_{step:08d}"


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def manifest(path: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has none (or an unreadable one)."""
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def problems(path: Path, *, checksums: bool = False) -> list[str]:
    """What is wrong with the checkpoint at ``path`` (empty: it is complete and, with ``checksums``, intact)."""
    meta = manifest(path)
    if meta is None:
        return [f"no readable {MANIFEST} (an interrupted save)"]
    out = []
    for name, rec in meta["files"].items():
        size, digest = (rec, None) if isinstance(rec, int) else (rec["size"], rec["sha256"])
        f = path / name
        if not f.is_file():
            out.append(f"{name} is missing")
        elif f.stat().st_size != size:
            out.append(f"{name} has {f.stat().st_size} bytes, the manifest says {size}")
        elif checksums and digest is not None and sha256(f) != digest:
            out.append(f"{name} does not match its sha256")
    return out


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` whose files match their checksums (None if there is none).

    Newer directories that are incomplete or corrupt are skipped with a warning that names them.
    """
    if not root.is_dir():
        return None
    for p in sorted(root.glob("step_*"), reverse=True):
        bad = problems(p, checksums=True)
        if not bad:
            return p
        log.warning("skipping checkpoint %s: %s", p, "; ".join(bad))
    return None


def resolve(path: str) -> Path:
    """A checkpoint directory, or the latest valid one under a checkpoints root; ConfigError if none."""
    p = Path(path).expanduser()
    if manifest(p) is not None:  # the user named one checkpoint: it must be intact
        bad = problems(p, checksums=True)
        if bad:
            raise ConfigError(f"train.resume={path}: this checkpoint is damaged ({'; '.join(bad)}); "
                              f"point train.resume at its parent directory to use the newest intact one")  # fmt: skip
        return p
    found = latest(p)
    if found is None:
        raise ConfigError(f"train.resume={path}: no complete checkpoint there (a step_* directory with {MANIFEST})")
    return found


SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""Model fields that decide the shape of the saved weights."""


def check_compatible(path: Path, model_cfg: dict[str, Any]) -> None:
    """Refuse, before anything is built, to resume a checkpoint of another model shape (names every difference).

    Other model fields (init, rope_theta, max_seq_len, ...) may change on resume; each change is logged.
    """
    saved = (manifest(path) or {}).get("model")
    if saved is None:  # a checkpoint from before the shape was recorded: load_state_dict will check
        return
    changed = [k for k in sorted(set(saved) | set(model_cfg)) if k != "name" and saved.get(k) != model_cfg.get(k)]
    diff = [f"model.{k}={saved.get(k)!r} in the checkpoint but {model_cfg.get(k)!r} now" for k in changed]
    if any(k in SHAPE_KEYS for k in changed):
        raise ConfigError(
            f"cannot resume {path}: the model shape changed ({'; '.join(diff)}). Resume with the checkpoint's "
            "model settings, or start a new run without train.resume"
        )
    for line in diff:
        log.info("resuming with a changed setting: %s", line)


def save(backend: Backend, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any],
         step: int, keep_last: int, keep_every: int = 0, meta: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """Write one checkpoint atomically, then delete all but the newest ``keep_last`` (0 keeps all).

    Checkpoints at multiples of ``keep_every`` (0: none) are kept permanently. ``meta`` (e.g. the model shape) is
    recorded in the manifest next to every file's size and sha256.
    """
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.save(tmp, model, optimizer, extra)
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}  # fmt: skip
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"step": step, "files": files, **(meta or {})}, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_last > 0:
        done = [p for p in sorted(root.glob("step_*")) if not p.name.endswith(".tmp")]
        for old in done[:-keep_last]:
            old_step = int(old.name.removeprefix("step_"))
            if keep_every and old_step % keep_every == 0:
                continue  # a permanent checkpoint
            (old / MANIFEST).unlink(missing_ok=True)  # invalidate first: a half-deleted dir is never loaded
            shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointHook:
    """Loop hook: saves every ``every`` steps (0: never mid-run) and after the last step.

    ``extra_fn`` supplies the framework-neutral state (train state, data-loader position, RNG).
    """

    def __init__(self, backend: Backend, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 extra_fn: Any, *, every: int, last_step: int, keep_last: int, keep_every: int = 0,
                 meta: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.backend, self.root, self.model, self.optimizer = backend, root, model, optimizer
        self.extra_fn, self.every, self.last_step, self.keep_last = extra_fn, every, last_step, keep_last
        self.keep_every, self.meta = keep_every, meta
        self.last_saved: Path | None = None

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        if state.step == self.last_step or (self.every and state.step % self.every == 0):
            self.last_saved = save(self.backend, self.root, self.model, self.optimizer, self.extra_fn(state),
                                   state.step, self.keep_last, self.keep_every, self.meta)  # fmt: skip
