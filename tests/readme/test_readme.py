"""Every command of the README and the docs, run as a new user would: in a fresh shell after ``make demo`` and the
README's ``source .venv/bin/activate``, in order, each file's commands in a copy of the checkout of their own
(``tests/readme/commands.py`` says how each command is run, or why it cannot run here).

The shell starts from an empty environment (``env -i``: only ``PATH=/usr/local/bin:/usr/bin:/bin``, a fresh
``HOME`` that the files share, as one user's machine would, ``LANG``), so a command that works only with the
developer's activated venv, exported variables or caches fails here.

Files are independent, so ``make test-readme`` runs them on two pytest-xdist workers: each file's commands are one
unit of work, run in order on one worker (``tests/conftest.py``'s ``xdist_group``); a worker's files share its HOME.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.readme.commands import ACTIVATE, ROOT, TINY, Command, Plan, Policy

PLAN = Plan.of()
HANG_GUARD_S = 1800  # a hang guard only: no README command should come near it


def _copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files, with their times (so make sees the venv as up to
    date), and the venvs as links."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for venv in (".venv", ".venv-neuron"):
        if (ROOT / venv).is_dir():
            (dest / venv).symlink_to(ROOT / venv)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """For each file, a copy of the checkout that its commands run in, in order (made at its first command); one
    fresh HOME for all."""
    root = tmp_path_factory.mktemp("readme")
    (root / "home").mkdir()
    made: dict[str, Path] = {}

    def workdir(file: str) -> Path:
        if file not in made:
            work = root / file.replace("/", "-").removesuffix(".md") / "hlat"
            work.mkdir(parents=True)
            _copy_checkout(work)
            up_to_date = subprocess.run(["make", "-q", ".venv/.installed"], cwd=work, check=False)
            if up_to_date.returncode != 0:  # make demo would reinstall into the shared venv from this copy
                pytest.fail("the venv is older than pyproject.toml/constraints.txt: run `make install` first")
            made[file] = work
        return made[file]

    yield workdir


@contextmanager
def _venv_held(exclusive: bool) -> Iterator[None]:
    """The checkout's venv, held shared by a command, or alone by one that reinstalls into it (``checkout``: ``pip
    install -e .``), so that no command of another file, on another xdist worker, starts Python while pip swaps
    hlat's files."""
    with (ROOT / ".venv" / ".readme-lane.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _env(work: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work.parents[1] / "home"), "LANG": "C.UTF-8"}


def _shell(text: str, cwd: Path, work: Path, log: Path) -> subprocess.CompletedProcess[str]:
    script = f"{ACTIVATE}\n{text}\n" if not text.startswith("make ") else f"{text}\n"
    with log.open("w") as out:
        done = subprocess.run(
            ["env", "-i", *(f"{k}={v}" for k, v in _env(work).items()), "bash", "--noprofile", "--norc", "-c", script],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=HANG_GUARD_S,
            check=False,
        )
    return done


def _tiny(text: str, extra: tuple[str, ...]) -> str:
    """``text`` with ``extra`` and then :data:`TINY` appended, each key only once and never one ``text`` sets.

    A command that sets its own ``train.steps`` keeps its own warmup too: the README must be valid as written.
    """
    added: dict[str, str] = {w.split("=", 1)[0]: w for w in text.split() if "=" in w}
    tiny = [o for o in TINY if not (o.startswith("optimizer.warmup_steps=") and "train.steps" in added)]
    for override in (*extra, *tiny):
        added.setdefault(override.split("=", 1)[0], override)
    return " ".join([text, *(o for o in added.values() if o not in text.split())])


def _setup_corpus(work: Path) -> None:
    """The user's own data: the builtin corpus as two JSONL files under ``corpus/``."""
    from hlat.data.builtin import collect_documents

    docs = collect_documents()
    (work / "corpus").mkdir(exist_ok=True)
    half = len(docs) // 2
    for name, part in (("a.jsonl", docs[:half]), ("b.jsonl", docs[half:])):
        with (work / "corpus" / name).open("w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)


SETUPS = {"corpus": _setup_corpus}


def _serve(text: str, policy: Policy, work: Path, log: Path) -> str:
    """Start the server command, wait until it answers, return what its experiments page lists; stop it."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                "env",
                "-i",
                *(f"{k}={v}" for k, v in _env(work).items()),
                "bash",
                "--noprofile",
                "--norc",
                "-c",
                f"{ACTIVATE}\nexec {text}\n",
            ],
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{policy.port}/ajax-api/2.0/mlflow/experiments/search?max_results=1000"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    return r.read().decode()
            except OSError:
                time.sleep(1)
        pytest.fail(f"{text} never answered on port {policy.port}: {log.read_text()[-3000:]}")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


@pytest.mark.parametrize(("command", "policy"), PLAN.items, ids=[c.where for c, _ in PLAN.items])
def test_readme_command(command: Command, policy: Policy, workdirs: Callable[[str], Path]) -> None:
    if policy.action == "skip":
        pytest.skip(f"{command.where} `{command.text}`: {policy.why}")
    workdir = workdirs(command.file)
    log = workdir.parent / f"L{command.line}.log"
    if policy.setup:
        SETUPS[policy.setup](workdir)
    if policy.action == "serve":
        with _venv_held(exclusive=False):
            listing = _serve(command.text, policy, workdir, log)
        assert policy.probe in listing, listing[:3000]
        return
    text, cwd = command.text, workdir
    if policy.action == "tiny":
        text = _tiny(text, policy.extra)
    elif policy.action == "make_tiny":
        text = f'{text} ARGS="{" ".join(TINY)}"'
    elif policy.action == "checkout":
        cwd = ROOT
    t0 = time.monotonic()
    with _venv_held(exclusive=policy.action == "checkout"):
        done = _shell(text, cwd, workdir, log)
    output = log.read_text(errors="replace")
    print(f"{command.where} ({time.monotonic() - t0:.0f} s): {text}")
    assert done.returncode == policy.returncode, (
        f"{command.where} `{text}` exited {done.returncode} (expected {policy.returncode}):\n{output[-4000:]}"
    )
    assert policy.output in output, f"`{text}` did not print {policy.output!r}:\n{output[-3000:]}"
