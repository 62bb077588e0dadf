"""Evaluations along training: ``hlat eval`` on the first complete checkpoint past every ``eval.every_tokens``.

Each runs in a child process (``python -m hlat.cli eval``) on the torch backend whatever the job's layout, logging
into the training run; training imports nothing of :mod:`hlat.eval`.
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


class EvalFailedError(RuntimeError):
    """An evaluation along training failed (``eval.on_error=fail``); training itself finished, its checkpoints kept."""


def check(cfg: RunConfig) -> None:
    """Before anything is built: lm-eval can be imported and knows every task that ``eval.every_tokens`` evaluates.

    Asked of ``python -m hlat.eval.tasks`` in a child process (~2 s), as the evaluations will be; a dry run skips it.

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
    from hlat.track.mlflow_store import ENV_URI, resolve_store

    if e.every_tokens < tokens_per_step * cfg.train.checkpoint_every:
        log.warning(
            "eval.every_tokens=%d is below one checkpoint interval (%d tokens): evaluations happen at checkpoints only",
            e.every_tokens,
            tokens_per_step * cfg.train.checkpoint_every,
        )
    store = resolve_store(cfg.tracker.uri, given_as="tracker.uri")  # the run's (the entry settled tracker.uri)
    where = [] if store.source == ENV_URI else [f"tracker.uri={store.uri}"]  # the child inherits the variable
    tracker = (
        ["tracker=console"]
        if cfg.tracker.kind != "mlflow"
        else [*where, f"tracker.experiment={cfg.tracker.experiment}"]
    )
    overrides = [*eval_overrides(e), *tracker]  # every eval field: command-line changes to the preset reach the child
    first = (tokens_seen // e.every_tokens + 1) * e.every_tokens  # a resumed run evaluates from where it is
    return EvalScheduler(e, tokens_per_step, overrides, next_tokens=first)


def eval_overrides(e: EvalConfig) -> list[str]:
    """The overrides that give a child ``hlat eval`` exactly this run's ``eval``: the preset, then every field."""
    tasks = ",".join(f"{{task:'{_escape(t.task)}',num_fewshot:{t.num_fewshot}}}" for t in e.tasks)
    limit = "null" if e.limit is None else e.limit
    device = "null" if e.device is None else e.device
    return [
        f"eval={e.name}",
        f"eval.tasks=[{tasks}]",
        f"eval.batch_size={e.batch_size}",
        f"eval.limit={limit}",
        f"eval.device={device}",
    ]


def _escape(text: str) -> str:
    """``text`` inside a single-quoted Hydra override string."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


@dataclass
class EvalScheduler:
    """Checkpointer hook (``on_saved``, rank 0): ``hlat eval`` on the first checkpoint past every ``every_tokens``.

    A failure is logged at the next checkpoint; :meth:`finish` waits for the rest and fails the run if one failed.
    """

    cfg: EvalConfig
    tokens_per_step: int
    overrides: list[str]
    next_tokens: int = 0
    procs: list[tuple[subprocess.Popen, Path, Path]] = field(default_factory=list)
    """The evaluations not yet seen to end: process, checkpoint, log file."""
    failed: list[tuple[Path, int, Path]] = field(default_factory=list)
    """The evaluations that failed: checkpoint, exit code, log file."""

    def __post_init__(self) -> None:
        self.next_tokens = self.next_tokens or self.cfg.every_tokens

    def __call__(self, ckpt: Path, step: int) -> None:
        self._collect(wait=False)  # a failed evaluation is reported now, not only when training ends
        tokens = step * self.tokens_per_step
        if not self.cfg.every_tokens or tokens < self.next_tokens:
            return
        while self.next_tokens <= tokens:
            self.next_tokens += self.cfg.every_tokens
        cmd = [sys.executable, "-m", "hlat.cli", "eval", f"checkpoint={ckpt}", *self.overrides]
        out = ckpt.parent / "eval" / f"{self.cfg.name}_{ckpt.name}.log"  # a file, not a pipe nobody reads
        out.parent.mkdir(exist_ok=True)
        log.info(
            "evaluating %s (%s tokens) on eval=%s in the background; log: %s",
            ckpt.name,
            f"{tokens:,}",
            self.cfg.name,
            out,
        )
        with open(out, "w") as f:
            self.procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), ckpt, out))

    def _collect(self, wait: bool) -> None:
        """Take in the evaluations that ended (every one if ``wait``); log each failed one with its log's tail."""
        running = []
        for proc, ckpt, out in self.procs:
            code = proc.wait() if wait else proc.poll()
            if code is None:
                running.append((proc, ckpt, out))
            elif code:
                tail = out.read_text(errors="replace")[-2000:] if out.is_file() else ""
                level = logging.ERROR if self.cfg.on_error == "fail" else logging.WARNING
                log.log(level, "the evaluation of %s failed (exit %d, log %s): %s", ckpt.name, code, out, tail)
                self.failed.append((ckpt, code, out))
        self.procs = running

    def close(self) -> None:
        """Wait for the evaluations still running; log the ones that failed."""
        self._collect(wait=True)

    def finish(self) -> None:
        """Training is done: wait for the evaluations, and fail the run if one failed and ``eval.on_error=fail``.

        Raises:
            EvalFailedError: One or more failed; the message names each and how to evaluate them again.
        """
        self.close()
        if not self.failed or self.cfg.on_error != "fail":
            return
        ckpt, _, out = self.failed[0]
        which = ", ".join(f"{c.name} (exit {code})" for c, code, _ in self.failed)
        lines = out.read_text(errors="replace").strip().splitlines() if out.is_file() else []
        again = shlex.join(["hlat", "eval", f"checkpoint={ckpt.parent}", "all_checkpoints=true", *self.overrides])
        raise EvalFailedError(
            f"the evaluation along training of {which} failed; {out}: {lines[-1] if lines else 'empty'}. Training "
            f"finished and its checkpoints are kept: fix the cause and evaluate them with `{again}`, or set "
            "eval.on_error=warn to only warn when an evaluation fails"
        )
