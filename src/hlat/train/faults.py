"""Fault injection (``conf/fault/``): the failures HLAT's automatic recovery had to survive, on demand.

Each fault fires once per job: a marker under ``<checkpoint dir>/faults/`` is written first, so the restarted
process, replaying the steps since the last checkpoint, runs past it.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hlat.config import ConfigError, FaultConfig
from hlat.state import Hook, StepOutput, TrainState

log = logging.getLogger(__name__)


def kill_steps(cfg: FaultConfig, steps: int) -> list[int]:
    """The steps after which the trainer is killed: ``kill_at`` plus ``kill_random`` distinct seeded draws."""
    out = set(cfg.kill_at)
    pool = [s for s in range(1, steps) if s not in out]
    out.update(random.Random(cfg.seed).sample(pool, min(cfg.kill_random, len(pool))))
    return sorted(out)


def _largest_file(path: Path) -> Path:
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"]
    return max(files, key=lambda p: p.stat().st_size)


class FaultInjector:
    """Fires the faults of ``cfg``: a loop hook (kills, the hang), a grad hook (NaN), a checkpoint callback (saves).

    Only rank 0 injects save faults; every rank may be killed. ``steps`` bounds the random kills.
    """

    def __init__(self, cfg: FaultConfig, steps: int, markers: Path, rank: int = 0) -> None:
        self.cfg, self.markers, self.rank = cfg, markers, rank
        self.kills = set(kill_steps(cfg, steps))
        self.hang_group = self._hang_group(cfg)
        self.step_ended = time.monotonic()  # the first step's start, near enough: for ``min_step_s``
        if cfg.active:
            log.warning(
                "fault injection (fault=%s): kill after steps %s, crash in save %s, corrupt %s, disk full %s, NaN "
                "gradients at %s, hang at %s / SIGSTOP at %s on rank %d, a graph of its own at %s on rank %d, steps of "
                "at least %gs",
                *(cfg.name, sorted(self.kills), cfg.crash_in_save_at, cfg.corrupt_at, cfg.disk_full_at),
                *(cfg.nonfinite_at, cfg.hang_at, cfg.sigstop_at, cfg.hang_rank, cfg.graph_at, cfg.graph_rank),
                cfg.min_step_s,
            )

    @staticmethod
    def _hang_group(cfg: FaultConfig) -> dist.ProcessGroup | None:
        """A gloo group of its own for the hang (collective: every rank builds the injector at the same point)."""
        if cfg.hang_at is None and cfg.sigstop_at is None:
            return None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if cfg.hang_rank >= world:
            raise ConfigError(
                f"fault.hang_rank={cfg.hang_rank} is not a rank of this {world}-rank job; set "
                "fault.hang_rank below the world size (0 in a one-process run)"
            )
        return dist.new_group(backend="gloo") if world > 1 and cfg.hang_at is not None else None

    def _once(self, name: str) -> bool:
        """True the first time ``name`` is asked for in this job (a marker file makes it durable)."""
        marker = self.markers / f"{name}.rank{self.rank}"
        if marker.exists():
            return False
        self.markers.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as f:
            f.flush()
            os.fsync(f.fileno())
        return True

    def _kill(self, why: str) -> None:
        log.warning("fault injection: SIGKILL %s", why)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def __call__(self, state: TrainState, out: StepOutput) -> None:
        """Loop hook (the last, after the checkpoint hook): pace the step; kill, hang or stop after the chosen steps."""
        if self.cfg.min_step_s:
            time.sleep(max(0.0, self.cfg.min_step_s - (time.monotonic() - self.step_ended)))
            self.step_ended = time.monotonic()
        if state.step in self.kills and self._once(f"kill-{state.step}"):
            self._kill(f"after step {state.step}")
        mine = self.rank == self.cfg.hang_rank
        if mine and state.step == self.cfg.hang_at and self._once(f"hang-{state.step}"):
            self._hang(state.step)
        if mine and state.step == self.cfg.sigstop_at and self._once(f"sigstop-{state.step}"):
            self._sigstop(state.step)

    def _sigstop(self, step: int) -> None:
        """Freeze this process, every thread with it (its heartbeat too): only SIGCONT or SIGKILL ends that."""
        log.warning("fault injection: rank %d stops itself with SIGSTOP after step %d", self.rank, step)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGSTOP)

    def _hang(self, step: int) -> None:
        """Block for good: in an all-reduce no other rank joins (they block in the next step's), or on a wait."""
        log.warning(
            "fault injection: rank %d hangs after step %d %s",
            self.rank,
            step,
            "in an all-reduce that no other rank joins" if self.hang_group else "on a wait",
        )
        for h in logging.getLogger().handlers:
            h.flush()
        if self.hang_group is not None:  # returns only by raising, when the group's collective timeout expires
            dist.all_reduce(torch.zeros(1), group=self.hang_group)
        threading.Event().wait()  # what a stuck data worker looks like to the loop

    def poison_grads(self, step: int, model: nn.Module) -> None:
        """Grad hook: NaN into the first gradient at the steps of ``nonfinite_at``."""
        if step in self.cfg.nonfinite_at and self._once(f"nonfinite-{step}"):
            log.warning("fault injection: NaN gradients at step %d", step)
            p = next(p for p in model.parameters() if p.grad is not None)
            with torch.no_grad():
                p.grad.fill_(float("nan"))

    def diverge_graph(self, step: int, model: nn.Module) -> None:
        """Grad hook: at ``graph_at``, rank ``graph_rank`` adds zeros to one gradient, an op only its graph holds."""
        if step == self.cfg.graph_at and self.rank == self.cfg.graph_rank and self._once(f"graph-{step}"):
            log.warning("fault injection: rank %d traces a graph of its own at step %d", self.rank, step)
            p = next(p for p in model.parameters() if p.grad is not None)
            with torch.no_grad():
                p.grad.add_(torch.zeros_like(p.grad))

    def on_save(self, stage: str, step: int, path: Path) -> None:
        """Checkpoint callback (``hlat.checkpoint.SaveFault``)."""
        if self.rank != 0:
            return
        cfg = self.cfg
        if stage == "written" and step == cfg.crash_in_save_at and self._once(f"crash_in_save-{step}"):
            self._kill(f"while writing the checkpoint of step {step} (files written, no manifest)")
        if stage == "written" and step == cfg.disk_full_at and self._once(f"disk_full-{step}"):
            victim = _largest_file(path)
            with open(victim, "r+b") as f:  # what a full disk leaves behind: a short file
                f.truncate(victim.stat().st_size // 2)
            log.warning("fault injection: ENOSPC writing %s", victim)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(victim))
        if stage == "complete" and step == cfg.corrupt_at and self._once(f"corrupt-{step}"):
            victim = _largest_file(path)
            with open(victim, "r+b") as f:  # one flipped byte, same size: only the checksum can tell
                f.seek(victim.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            self._kill(f"after corrupting {victim}")


@dataclass(frozen=True)
class FaultHooks:
    """Where fault injection plugs into training (all empty when ``fault`` injects nothing)."""

    loop: list[Hook] = field(default_factory=list)
    """After every step, the last loop hooks but the stop hook (kills, the hang, the step pacing)."""
    grad: list[Callable[[int, nn.Module], None]] = field(default_factory=list)
    """While the step's gradients exist (NaN gradients)."""
    on_save: Callable[[str, int, Path], None] | None = None
    """The checkpoint callback (``hlat.checkpoint.SaveFault``: crashes, a full disk, corruption)."""


def fault_hooks(cfg: FaultConfig, steps: int, markers: Path, rank: int) -> FaultHooks:
    """The hooks that inject ``cfg``'s faults (see :class:`FaultInjector` for the arguments); none when it is off."""
    if not cfg.active:
        return FaultHooks()
    injector = FaultInjector(cfg, steps, markers, rank)
    grad = [injector.poison_grads, injector.diverge_graph]
    return FaultHooks(loop=[injector], grad=grad, on_save=injector.on_save)
