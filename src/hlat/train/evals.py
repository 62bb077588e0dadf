"""Evaluations along training: ``hlat eval`` on the first complete checkpoint past every ``eval.every_tokens``.

A hook of the checkpointer on rank 0 (``on_saved``). Each evaluation runs in its own process (``python -m hlat.cli
eval``): it needs no rank of the training job, runs on the torch backend whatever the job's layout, and logs into
the training run at the checkpoint's step. Training imports nothing of :mod:`hlat.eval`: :func:`check` asks a child
process too (``python -m hlat.eval.tasks``) whether lm-eval is installed and knows the tasks, before anything is
built.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hlat.config import ConfigError, EvalConfig, RunConfig

log = logging.getLogger(__name__)


def check(cfg: RunConfig) -> None:
    """Before anything is built: lm-eval can be imported and knows every task that ``eval.every_tokens`` evaluates.

    Asked of ``python -m hlat.eval.tasks`` in a child process, with this Python, as the evaluations themselves
    will be (~2 s: lm-eval's import and hlat's task index; lm-eval's own ~15k task names are cached in
    ``data.cache_dir``). A dry run (``train.dry_run``) plans without it: it may run where lm-eval is not installed.

    Raises:
        ConfigError: lm-eval is missing (the extra to install is named) or does not know a task (the closest names).
    """
    e = cfg.eval
    if not e.every_tokens or cfg.train.dry_run:
        return
    names = [t.task for t in e.tasks]
    cmd = [sys.executable, "-m", "hlat.eval.tasks", f"--preset={e.name}", f"--cache-dir={cfg.data.cache_dir}", *names]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        return
    said = [line for line in done.stderr.splitlines() if line.startswith(_CONFIG_ERROR)]
    if done.returncode == 2 and said:
        raise ConfigError(said[-1].removeprefix(_CONFIG_ERROR))
    last = done.stderr.strip().splitlines()[-1:] or ["no output"]
    raise ConfigError(
        f"eval={e.name}: checking its tasks with lm-eval failed (exit {done.returncode}: {last[0]}); run "
        f"`{shlex.join(['python', *cmd[1:]])}` to see why, or train with eval.every_tokens=0"
    )


_CONFIG_ERROR = "hlat: configuration error: "


def scheduler(cfg: RunConfig, tokens_per_step: int, tokens_seen: int) -> EvalScheduler | None:
    """The hook that evaluates checkpoints along training (``eval.every_tokens``), or None when that is off."""
    e = cfg.eval
    if not e.every_tokens:
        return None
    from hlat.track.trackers import default_uri

    if e.every_tokens < tokens_per_step * cfg.train.checkpoint_every:
        log.warning("eval.every_tokens=%d is below one checkpoint interval (%d tokens): evaluations happen at "
                    "checkpoints only", e.every_tokens, tokens_per_step * cfg.train.checkpoint_every)  # fmt: skip
    tracker = (
        ["tracker=console"]
        if cfg.tracker.kind != "mlflow"
        else [f"tracker.uri={cfg.tracker.uri or default_uri()}", f"tracker.experiment={cfg.tracker.experiment}"]
    )
    overrides = [*eval_overrides(e), *tracker]  # every eval field: command-line changes to the preset reach the child
    first = (tokens_seen // e.every_tokens + 1) * e.every_tokens  # a resumed run evaluates from where it is
    return EvalScheduler(e, tokens_per_step, overrides, next_tokens=first)


def eval_overrides(e: EvalConfig) -> list[str]:
    """The overrides that give a child ``hlat eval`` exactly this run's ``eval`` config.

    The preset, then every field an evaluation reads: a command-line change to the preset (``eval.tasks=...``,
    ``eval.limit=...``) reaches the child instead of the preset's value.
    """
    tasks = ",".join(f"{{task:'{_escape(t.task)}',num_fewshot:{t.num_fewshot}}}" for t in e.tasks)
    limit = "null" if e.limit is None else e.limit
    device = "null" if e.device is None else e.device
    return [f"eval={e.name}", f"eval.tasks=[{tasks}]", f"eval.batch_size={e.batch_size}", f"eval.limit={limit}",
            f"eval.device={device}"]  # fmt: skip


def _escape(text: str) -> str:
    """``text`` inside a single-quoted Hydra override string."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


@dataclass
class EvalScheduler:
    """Training hook: start ``hlat eval`` on the first complete checkpoint past every ``every_tokens`` tokens.

    Called by the Checkpointer on rank 0 once a checkpoint is complete (``on_saved``). The evaluation runs in its own
    process, on the torch backend, logging into the training run at the checkpoint's step; ``close`` waits for the
    ones still running. ``overrides`` carry the eval preset and the tracker into the child.
    """

    cfg: EvalConfig
    tokens_per_step: int
    overrides: list[str]
    next_tokens: int = 0
    procs: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_tokens = self.next_tokens or self.cfg.every_tokens

    def __call__(self, ckpt: Path, step: int) -> None:
        tokens = step * self.tokens_per_step
        if not self.cfg.every_tokens or tokens < self.next_tokens:
            return
        while self.next_tokens <= tokens:
            self.next_tokens += self.cfg.every_tokens
        cmd = [sys.executable, "-m", "hlat.cli", "eval", f"checkpoint={ckpt}", *self.overrides]
        out = ckpt.parent / "eval" / f"{self.cfg.name}_{ckpt.name}.log"  # a file, not a pipe nobody reads
        out.parent.mkdir(exist_ok=True)
        log.info("evaluating %s (%s tokens) on eval=%s in the background; log: %s", ckpt.name, f"{tokens:,}",
                 self.cfg.name, out)  # fmt: skip
        with open(out, "w") as f:
            self.procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), out))

    def close(self) -> None:
        """Wait for the evaluations still running; report the ones that failed."""
        for proc, out in self.procs:
            if proc.wait():
                tail = out.read_text(errors="replace")[-2000:] if out.is_file() else ""
                log.warning("an evaluation along training failed (exit %d, log %s): %s", proc.returncode, out, tail)
        self.procs.clear()
