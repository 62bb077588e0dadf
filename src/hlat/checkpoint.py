"""Checkpoint policy: where and when to save, atomic step directories, finding the latest valid one.

*How* weights and optimizer state are written is the backend's business (``Backend.save``/``load``:
one file on the torch backend, sharded NxD files on Trainium). This module makes each save atomic: the
backend writes into ``step_XXXXXXXX.tmp/``, then ``manifest.json`` (step, files and their sizes) goes
in last and the directory is renamed. A directory without a manifest is never loaded.
"""

from __future__ import annotations

import json
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


def step_dir(root: Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` optimizer steps."""
    return root / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint is complete when its manifest exists and every listed file has its recorded size."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    files = json.loads(manifest.read_text())["files"]
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    if not root.is_dir():
        return None
    done = [p for p in sorted(root.glob("step_*")) if not p.name.endswith(".tmp") and is_complete(p)]
    return done[-1] if done else None


def resolve(path: str) -> Path:
    """A checkpoint directory, or the latest complete one under a checkpoints root; ConfigError if none."""
    p = Path(path).expanduser()
    if is_complete(p):
        return p
    found = latest(p)
    if found is None:
        raise ConfigError(f"train.resume={path}: no complete checkpoint there (a step_* directory with {MANIFEST})")
    return found


def save(backend: Backend, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any],
         step: int, keep_last: int) -> Path:  # fmt: skip
    """Write one checkpoint atomically, then delete all but the newest ``keep_last`` (0 keeps all)."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.save(tmp, model, optimizer, extra)
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"step": step, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_last > 0:
        done = [p for p in sorted(root.glob("step_*")) if not p.name.endswith(".tmp")]
        for old in done[:-keep_last]:
            (old / MANIFEST).unlink(missing_ok=True)  # invalidate first: a half-deleted dir is never loaded
            shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointHook:
    """Loop hook: saves every ``every`` steps (0: never mid-run) and after the last step.

    ``extra_fn`` supplies the framework-neutral state (train state, data-loader position, RNG).
    """

    def __init__(self, backend: Backend, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 extra_fn: Any, *, every: int, last_step: int, keep_last: int) -> None:  # fmt: skip
        self.backend, self.root, self.model, self.optimizer = backend, root, model, optimizer
        self.extra_fn, self.every, self.last_step, self.keep_last = extra_fn, every, last_step, keep_last
        self.last_saved: Path | None = None

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        if state.step == self.last_step or (self.every and state.step % self.every == 0):
            self.last_saved = save(self.backend, self.root, self.model, self.optimizer, self.extra_fn(state),
                                   state.step, self.keep_last)  # fmt: skip
