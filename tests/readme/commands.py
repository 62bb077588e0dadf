"""The README's shell commands, and what the README lane does with each (``make test-readme``).

Every command of every fenced ``bash`` block of README.md is listed here in order, with a :class:`Policy`: run it as
written, run it with tiny training overrides (``train.steps=2 ...``) where it trains, start it as a server and query
it, or skip it with the reason it cannot run on this machine. A README command without a policy, or an exception
whose command left the README, fails ``tests/unit/test_readme_commands.py`` in the main suite, so the README and
this list cannot drift apart.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ACTIVATE = "source .venv/bin/activate"
"""The README's convention: once per shell after ``make demo``; the lane runs every later command after it."""

TINY = (
    "train.steps=2",
    "optimizer.warmup_steps=1",
    "train.log_every=1",
    "train.seq_len=64",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
)
"""Appended to a command that trains (a key the command sets itself is not appended)."""


@dataclass(frozen=True)
class Command:
    """One shell command of the README: its text (continuations joined, comment removed) and where it is."""

    text: str
    line: int
    section: str


@dataclass(frozen=True)
class Policy:
    """What the README lane does with a command.

    Attributes:
        action: ``run`` (as written), ``tiny`` (with :data:`TINY` appended), ``make_tiny`` (``make demo`` with
            :data:`TINY` as its ``ARGS``), ``serve`` (start, query ``probe`` on ``port``, stop), ``checkout`` (run
            as written in the checkout the venv is installed from, not in the lane's copy: ``pip install -e .``), or
            ``skip``.
        why: Why a command is skipped, or what is special about it.
        returncode: The exit status the command must end with.
        output: Text the command's output must contain.
        extra: Overrides appended besides :data:`TINY` (``tiny`` only).
        setup: A name from ``tests/readme/test_readme.py``'s setups, run before the command (the user's own data).
        port: Where a ``serve`` command answers.
        probe: Text the answer of a ``serve`` command must contain.
    """

    action: str
    why: str = ""
    returncode: int = 0
    output: str = ""
    extra: tuple[str, ...] = ()
    setup: str | None = None
    port: int = 5000
    probe: str = ""


EXCEPTIONS: dict[str, Policy] = {
    "make demo": Policy("make_tiny", "the first command: the lane runs it with tiny ARGS (the venv exists already)"),
    "make test": Policy("skip", "the main suite: .ci/run runs it before this lane"),
    "make test-neuron": Policy("skip", "the NxD lane: .ci/run runs it before this lane (it builds .venv-neuron)"),
    "mlflow ui --backend-store-uri sqlite:///mlflow.db": Policy(
        "serve",
        "a server: started, asked for the experiments the commands before it made, stopped",
        probe="ablation_scaled_init",
    ),
    'pip install -c constraints.txt -e ".[eval]"': Policy(
        "checkout", "an editable install: run in the checkout itself, not in the lane's copy of it"
    ),
    "python train.py model=70b precision=master_weights": Policy(
        "run", "refused before anything is allocated on a laptop", returncode=2, output="GiB"
    ),
    "python train.py cluster=gpu_8x train.micro_batch_size=2": Policy(
        "run", "needs 8 CUDA GPUs: here it must stop at once and say why", returncode=2, output="no CUDA device"
    ),
    "torchrun --nproc-per-node 8 train.py cluster=gpu train.micro_batch_size=2": Policy(
        "skip", "needs 8 CUDA GPUs (its config and batch layout are checked by tests/unit/test_readme_commands.py)"
    ),
    "docker build --target trn1 -t 123456789012.dkr.ecr.us-east-1.amazonaws.com/hlat:trn1 .": Policy(
        "skip", "no Docker engine here: tests/unit/test_dockerfile.py lints the Dockerfile and replays its installs"
    ),
    "hlat eval checkpoint=outputs/myrun/checkpoints tasks=hlat_suite": Policy(
        "skip", "the paper's suite downloads its datasets from the Hugging Face Hub (nothing downloads in tests)"
    ),
    "python train.py fault=kill cluster.max_restarts=3": Policy(
        "tiny",
        "3 SIGKILLs at random steps of a 6-step run, recovered",
        extra=("train.steps=6", "train.checkpoint_every=2"),
    ),
    "lm_eval --model hf --model_args pretrained=export/myrun,dtype=float32 --tasks hlat_local_ppl --include_path "
    "src/hlat/eval/tasks --device cpu": Policy("run", "lm-eval's own CLI and `hf` model on the export"),
    "hlat data prepare corpus/*.jsonl --output data/arrow": Policy(
        "run", "the user's corpus: the lane writes corpus/*.jsonl first", setup="corpus"
    ),
}
"""Commands that the default rules (:func:`policy`) do not cover, by their exact text."""


def _default(text: str) -> Policy | None:
    words = shlex.split(text)
    trains = words[:2] in (["python", "train.py"], ["hlat", "train"])
    if trains and not any(w.startswith("train.dry_run=true") for w in words):
        return Policy("tiny")
    if words[:2] == [".venv-neuron/bin/python", "train.py"]:
        return Policy("run", "the NxD lane's environment, built by `make test-neuron` before this lane")
    if trains or words[0] == "hlat" or words[:3] == ["python", "-m", "hlat.eval.harness"]:
        return Policy("run")
    return None


def policy(command: Command) -> Policy:
    """The lane's policy for ``command``: its exception, else the rule for its kind (training runs are made tiny,
    ``hlat ...`` commands run as written).

    Raises:
        LookupError: The command has neither (add it to :data:`EXCEPTIONS`).
    """
    found = EXCEPTIONS.get(command.text) or _default(command.text)
    if found is None:
        raise LookupError(f"README.md:{command.line}: no policy for {command.text!r}: add it to EXCEPTIONS in "
                          f"{Path(__file__).relative_to(ROOT)}")  # fmt: skip
    return found


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` inside quotes, or inside a word, is kept)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def commands(readme: Path = README) -> list[Command]:
    """Every command of the README's fenced ``bash`` blocks, in order.

    Continuation lines (``\\`` at the end) are joined, comments and blank lines dropped.
    """
    found: list[Command] = []
    section, block, start = "", None, 0
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if block is None and line.startswith("#"):
            section = line.lstrip("# ").strip()
        if block is None and re.fullmatch(r"```(bash|sh|shell)", line.strip()):
            block, start = [], number
        elif block is not None and line.strip() == "```":
            found += _block_commands(block, start, section)
            block = None
        elif block is not None:
            block.append(line)
    return found


def _block_commands(lines: list[str], start: int, section: str) -> list[Command]:
    out, pending, first = [], "", 0
    for offset, raw in enumerate(lines, 1):
        if not pending:
            first = start + offset
        text = raw.rstrip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        full = _strip_comment(pending + text)
        pending = ""
        if full and not full.startswith("#"):
            out.append(Command(" ".join(full.split()), first, section))
    return out


@dataclass
class Plan:
    """The commands in order with their policies (the lane runs ``ACTIVATE`` in front of every later command)."""

    items: list[tuple[Command, Policy]] = field(default_factory=list)

    @classmethod
    def of(cls, readme: Path = README) -> Plan:
        """Every README command after the activation line, with its policy."""
        cmds = commands(readme)
        after = [c for c in cmds if c.text != ACTIVATE]
        return cls([(c, policy(c)) for c in after])
