"""The shell commands of the README and the docs, and what the README lane does with each (``make test-readme``).

Every command of every fenced ``bash`` block of README.md, ARCHITECTURE.md and docs/*.md is listed here in order,
with a :class:`Policy`: run it as written, run it with tiny training overrides (``train.steps=2 ...``) where it
trains, start it as a server and query it, or skip it with the reason it cannot run on this machine. A command
without a policy, or an exception whose command left every file, fails ``tests/unit/test_readme_commands.py`` in the
main suite, so the docs and this list cannot drift apart. Each file's commands run in order in a checkout of their
own, so a command may rely on the commands before it in its file, never on another file's.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
DOCS = ROOT / "docs"
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
RAN_BEFORE = "the same command, under the same policy, ran at "
"""Why a command is skipped that an earlier file runs as written (:meth:`Plan.of`)."""


@dataclass(frozen=True)
class Command:
    """One shell command of a doc: its text (continuations joined, comment removed) and where it is."""

    text: str
    line: int
    section: str
    file: str = "README.md"

    @property
    def where(self) -> str:
        """``file:line``, as an error message or a test id names it."""
        return f"{self.file}:{self.line}"


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
    'make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"': Policy(
        "skip",
        "installs torch from download.pytorch.org into a new .venv (no such download here); the choice of index is "
        "tests/unit/test_torch_pip_args.py's, against a loopback index",
    ),
    "make test": Policy("skip", "the main suite: .ci/run runs it before this lane"),
    "make test-neuron": Policy("skip", "the NxD lane: .ci/run runs it beside this lane, .venv-neuron built before"),
    "make test-slow": Policy("skip", "the slow suite: .ci/run runs it before this lane"),
    "make test-cluster": Policy(
        "skip", "the cluster lane: .ci/run runs it before this lane (root, network namespaces)"
    ),
    "make test-postgres": Policy("skip", "the PostgreSQL lane: .ci/run runs it (root; apt-get install postgresql)"),
    "make test-image": Policy("skip", "the image lane: .ci/run runs it (root, podman, images built from local bases)"),
    "make test-readme": Policy("skip", "this lane itself"),
    "make test-bitwise": Policy("skip", "the bitwise tests on the AVX2 kernels: .ci/run runs it beside the slow lane"),
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
    "docker build --target cpu -t hlat:cpu .": Policy("skip", "no Docker engine here"),
    "mkdir -p outputs mlruns && chown 1000:1000 outputs mlruns": Policy("run", "the folders the container writes"),
    'docker run --rm -v "$PWD/outputs:/opt/hlat/outputs" -v "$PWD/mlruns:/opt/hlat/mlruns" hlat:cpu '
    "tracker.uri=sqlite:////opt/hlat/mlruns/mlflow.db train.steps=10 optimizer.warmup_steps=2": Policy(
        "skip", "no Docker engine here: the image lane runs the podman form as written (tests/image/test_docs.py)"
    ),
    "podman build --target cpu -t hlat:cpu .": Policy(
        "skip", "needs python:3.12-slim from a registry: the image lane builds the target on a local base instead"
    ),
    'podman run --rm -v "$PWD/outputs:/opt/hlat/outputs" -v "$PWD/mlruns:/opt/hlat/mlruns" hlat:cpu '
    "tracker.uri=sqlite:////opt/hlat/mlruns/mlflow.db train.steps=10 optimizer.warmup_steps=2": Policy(
        "skip", "needs the built image and podman: the image lane runs it as written (tests/image/test_docs.py)"
    ),
    "docker push 123456789012.dkr.ecr.us-east-1.amazonaws.com/hlat:trn1": Policy("skip", "no image, no registry"),
    "kubectl apply -f job.yaml": Policy("skip", "no Kubernetes cluster here (the PyTorchJob is schema-checked)"),
    "hlat doctor cluster=gpu_8x health.expected_busbw_gbps_intra=150": Policy(
        "run", "needs 8 CUDA GPUs: here it must stop at once and say why", returncode=2, output="no CUDA device"
    ),
    "torchrun --nnodes 4 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 -m hlat.cli.doctor "
    "cluster=trn1_x4": Policy("skip", "needs 4 trn1 nodes (the cluster lane runs torchrun across two hosts)"),
    "hlat compile --run cluster=trn1_1node experiment=hlat_7b": Policy(
        "run",
        "needs a trn1 host: here it must refuse and say where to run it",
        returncode=2,
        output="neuron_parallel_compile is not on PATH",
    ),
    "python -m pytest -q tests/unit/test_plan_model.py tests/unit/test_plan_paper.py "
    "tests/unit/test_plan_cli.py": Policy(
        "run", "the planner's tests (the lane's venv has the dev tools: make test-readme installs them)"
    ),
    "hlat eval checkpoint=outputs/myrun/checkpoints tasks=hlat_suite": Policy(
        "skip", "the paper's suite downloads its datasets from the Hugging Face Hub (nothing downloads in tests)"
    ),
    "python train.py fault=kill cluster.max_restarts=3": Policy(
        "tiny",
        "one SIGKILL at a random step of a 6-step run, recovered (each restart is a new trainer process; three kills "
        "at the restart limit, ending bitwise equal, are tests/integration/test_fault_recovery.py's)",
        extra=("train.steps=6", "train.checkpoint_every=2", "fault.kill_random=1"),
    ),
    "lm_eval --model hf --model_args pretrained=export/myrun,dtype=float32 --tasks hlat_local_ppl --include_path "
    "src/hlat/eval/tasks --device cpu": Policy("run", "lm-eval's own CLI and `hf` model on the export"),
    "lm_eval --model hf --model_args pretrained=export/myrun-neuron-hf,dtype=float32 --tasks hlat_local_ppl "
    "--include_path src/hlat/eval/tasks --device cpu": Policy("run", "lm-eval's `hf` model on a neuron run's export"),
    ".venv-neuron/bin/hlat graphs plan -m --config-dir sweeps --config-name precision_ablation cluster=xla_cpu "
    "--out outputs/graphs/precision --jobs 2": Policy(
        "skip", "5 twins traced with NxD (minutes): the NxD lane runs this plan (tests/neuron/test_graph_plan.py)"
    ),
    ".venv-neuron/bin/hlat graphs plan cluster=xla_cpu --verify optimizer.beta2=0.95,0.99 "
    "--out outputs/graphs/beta2": Policy(
        "skip", "2 twins traced with NxD: the NxD lane's plan traces this pair (bf16_sr and bf16_sr_beta2_0.99)"
    ),
    "hlat compile --audit /var/tmp/neuron-compile-cache": Policy(
        "skip", "no Neuron compile cache here: tests/unit/test_sweep_compile.py audits one of every entry state"
    ),
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
        return Policy("run", "the NxD lane's environment (tests/neuron/setup_venv.sh), built before this lane")
    if trains or words[0] == "hlat" or (words[:2] == ["python", "-m"] and words[2].startswith("hlat.")):
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
        raise LookupError(
            f"{command.where}: no policy for {command.text!r}: add it to EXCEPTIONS in "
            f"{Path(__file__).relative_to(ROOT)}"
        )
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


def sources() -> list[Path]:
    """The files whose commands the lane runs: README.md, then ARCHITECTURE.md, then docs/*.md by name."""
    return [README, *([ARCHITECTURE] if ARCHITECTURE.is_file() else []), *sorted(DOCS.glob("*.md"))]


def _name(path: Path) -> str:
    """``path`` relative to the checkout (``docs/trn1.md``); a file elsewhere (a test's) by its name."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def commands(readme: Path = README) -> list[Command]:
    """Every command of the fenced ``bash`` blocks of one file (the README by default), in order.

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
            found += _block_commands(block, start, section, _name(readme))
            block = None
        elif block is not None:
            block.append(line)
    return found


def all_commands() -> list[Command]:
    """Every command of every file of :func:`sources`, file by file, in order."""
    return [c for path in sources() for c in commands(path)]


def _block_commands(lines: list[str], start: int, section: str, file: str) -> list[Command]:
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
            out.append(Command(" ".join(full.split()), first, section, file))
    return out


@dataclass
class Plan:
    """The commands in order with their policies (the lane runs ``ACTIVATE`` in front of every later command)."""

    items: list[tuple[Command, Policy]] = field(default_factory=list)

    @classmethod
    def of(cls, files: list[Path] | None = None) -> Plan:
        """Every command of ``files`` (default: :func:`sources`) but the activation line, with its policy.

        A command that an earlier file runs as written, under the same policy, is skipped here: the lane proves it
        once (README.md and docs/sweeps.md give the same ablation, docs/deploy.md and docs/trn1.md the same
        renders) -- unless a later command of its own file that runs names a path it names (docs/evaluation.md
        trains ``outputs/myrun`` as the README does, then evaluates it: in its own checkout, it needs its own run).
        A file's repeat of its own command still runs: its context may differ.
        """
        found: list[tuple[Command, Policy, Command]] = []
        first: dict[tuple[str, Policy], Command] = {}
        for c in (c for path in (files or sources()) for c in commands(path)):
            if c.text != ACTIVATE:
                p = policy(c)
                found.append((c, p, first.setdefault((c.text, p), c)))
        items: list[tuple[Command, Policy]] = []
        later_runs: dict[str, list[str]] = {}  # per file, the texts of its later commands that run
        for c, p, earlier in reversed(found):
            if p.action != "skip" and earlier.file != c.file and not _named_later(c, later_runs.get(c.file, [])):
                p = Policy("skip", f"{RAN_BEFORE}{earlier.where}")
            if p.action != "skip":
                later_runs.setdefault(c.file, []).append(c.text)
            items.append((c, p))
        return cls(items[::-1])


def _named_later(command: Command, later: list[str]) -> bool:
    """Whether one of ``later`` names a path that ``command`` names (a word with a ``/``, or its value after ``=``)."""
    paths = {w.split("=", 1)[-1] for w in shlex.split(command.text, comments=True) if "/" in w.split("=", 1)[-1]}
    return any(path in text for path in paths for text in later)
