"""Read the repository's Dockerfile: stages, ARG defaults, RUN/COPY steps and the ENTRYPOINT.

No Docker engine is needed. Two users: ``tests/unit/test_dockerfile.py`` asserts facts about the image from it,
and ``docker/check_install.sh`` replays one target's own COPY and RUN steps in a temporary virtualenv, so the
install commands that are checked are the Dockerfile's own text (they cannot drift apart).

Usage (what check_install.sh runs)::

    python docker/stages.py replay cpu --root DIR [--build-arg NAME=VALUE ...]

copies the stage's COPY sources into ``DIR/<WORKDIR>`` and prints a bash script that runs the stage's RUN
commands there, one fresh shell each (as ``docker build`` does), with the ARG and ENV values exported.
Only the subset of Dockerfile syntax this repository uses is understood (no heredocs, no ONBUILD).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
_VAR = re.compile(r"\$(?:\{(\w+)(?::?-([^}]*))?\}|(\w+))")


@dataclass
class Instruction:
    """One instruction: its keyword (upper case), raw argument text and first line number."""

    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    """One ``FROM`` block: its base (as written), its name and its instructions in order."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def args(self, global_args: dict[str, str], inherited: dict[str, str] | None = None) -> dict[str, str]:
        """ARG and ENV values at the end of the stage (a bare ``ARG X`` takes the global default).

        Args:
            global_args: The ARGs declared before the first FROM, with their defaults.
            inherited: ENV values of the stage this one is built FROM (ENV carries over, ARG does not).
        """
        values: dict[str, str] = dict(inherited or {})
        for ins in self.instructions:
            if ins.keyword == "ARG":
                name, _, default = ins.args.partition("=")
                values[name] = expand(unquote(default), values) if default else global_args.get(name, "")
            elif ins.keyword == "ENV":
                values.update({k: expand(v, values) for k, v in parse_env(ins.args).items()})
        return values

    def env(self, inherited: dict[str, str] | None = None) -> dict[str, str]:
        """The ENV values at the end of the stage, including those of the stage it is built FROM."""
        values: dict[str, str] = dict(inherited or {})
        for ins in self.all("ENV"):
            values.update({k: expand(v, values) for k, v in parse_env(ins.args).items()})
        return values

    def runs(self) -> list[str]:
        """The shell commands of the RUN instructions, without their ``--mount``/``--network`` flags."""
        return [re.sub(r"^(--\w+=\S+\s+)+", "", i.args) for i in self.all("RUN")]

    def entrypoint(self) -> list[str] | None:
        found = self.all("ENTRYPOINT")
        return json.loads(found[-1].args) if found else None

    def workdir(self) -> str | None:
        found = self.all("WORKDIR")
        return found[-1].args if found else None


@dataclass
class Dockerfile:
    """A parsed Dockerfile: parser directives, the ARGs before the first FROM, and the stages."""

    directives: dict[str, str]
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    def chain(self, stage: Stage) -> list[Stage]:
        """``stage`` and the earlier stages it is built FROM, the root first."""
        names = {s.name: s for s in self.stages[: self.stages.index(stage)] if s.name}
        return [*self.chain(names[stage.base]), stage] if stage.base in names else [stage]

    def values(self, stage: Stage) -> dict[str, str]:
        """ARG and ENV values at the end of ``stage`` (ENV inherited from the stages it is built FROM)."""
        env: dict[str, str] = {}
        for s in self.chain(stage)[:-1]:
            env = s.env(env)
        return stage.args(self.global_args, env)

    def workdir(self, stage: Stage) -> str:
        """The WORKDIR in effect at the end of ``stage`` (inherited from the stages it is built FROM)."""
        dirs = [d for s in self.chain(stage) if (d := s.workdir())]
        return dirs[-1] if dirs else "/"

    def base_image(self, stage: Stage) -> str:
        """The stage's FROM reference with the global ARG defaults substituted."""
        return expand(stage.base, self.global_args)


def unquote(value: str) -> str:
    """Strip one pair of matching quotes, as Docker does for ARG defaults."""
    value = value.strip()
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value


def parse_env(args: str) -> dict[str, str]:
    """The variables of one ENV instruction (``ENV A=1 B="x y"`` or the legacy ``ENV NAME value``)."""
    if "=" not in args.split()[0]:  # legacy form: ENV NAME value
        name, _, value = args.partition(" ")
        return {name: value.strip()}
    return dict(tok.split("=", 1) for tok in shlex.split(args))


def expand(text: str, values: dict[str, str]) -> str:
    """Substitute ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` as Docker does in FROM/COPY/WORKDIR."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return values.get(name) or (m.group(2) or "")

    return _VAR.sub(sub, text)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; drop comments (also those inside a continued instruction) and blanks."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, "".join(buf).strip()))  # Docker removes backslash + newline and nothing else
        buf = []
    if buf:
        out.append((start, "".join(buf).strip()))
    return out


def parse(path: Path = DOCKERFILE) -> Dockerfile:
    """Parse ``path`` into parser directives, global ARGs and stages."""
    text = path.read_text()
    directives: dict[str, str] = {}
    for raw in text.splitlines():  # parser directives: `# key=value` lines before anything else
        m = re.match(r"#\s*(\w+)\s*=\s*(\S+)\s*$", raw)
        if not m:
            break
        directives[m.group(1).lower()] = m.group(2)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, content in logical_lines(text):
        keyword, _, args = content.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            parts = [p for p in args.split() if not p.startswith("--platform")]
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            if keyword == "ARG":
                name, _, default = args.partition("=")
                global_args[name] = expand(unquote(default), global_args)  # may name an earlier ARG
        else:
            stages[-1].instructions.append(Instruction(keyword, args, line))
    return Dockerfile(directives, global_args, stages)


def _copy(sources: list[str], dest: Path, context: Path) -> None:
    """``COPY src... dest`` from the build context: a directory's contents, a file into a directory (``/``)."""
    for src in sources:
        origin = context / src
        if origin.is_dir():
            shutil.copytree(origin, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target = dest / origin.name if (len(sources) > 1 or str(dest).endswith("/") or dest.is_dir()) else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)


def replay(df: Dockerfile, target: str, root: Path, build_args: dict[str, str], context: Path = REPO) -> str:
    """Copy the target stage's COPY sources under ``root`` and return a bash script running its RUN steps."""
    stage = df.stage(target)
    values = {**df.values(stage), **build_args}
    workdir = root / expand(df.workdir(stage), values).lstrip("/")
    workdir.mkdir(parents=True, exist_ok=True)
    shells = [json.loads(i.args) for s in df.chain(stage)[:-1] for i in s.all("SHELL")]
    shell = shells[-1] if shells else ["/bin/sh", "-c"]
    lines = ["set -euo pipefail", f"cd {shlex.quote(str(workdir))}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    for ins in stage.instructions:
        if ins.keyword == "SHELL":
            shell = json.loads(ins.args)
        elif ins.keyword == "COPY":
            if "--from=" in ins.args:
                raise ValueError(f"line {ins.line}: COPY --from cannot be replayed outside Docker")
            parts = [p for p in shlex.split(ins.args) if not p.startswith("--")]
            dest = expand(parts[-1], values)
            dest_path = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
            if dest.endswith("/"):
                dest_path.mkdir(parents=True, exist_ok=True)
            _copy([expand(p, values) for p in parts[:-1]], dest_path, context)
        elif ins.keyword == "RUN":
            command = re.sub(r"^(--\w+=\S+\s+)+", "", ins.args)
            lines.append(f"echo '+ RUN (Dockerfile line {ins.line})' >&2")
            lines.append(shlex.join([*shell, command]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line: ``replay TARGET --root DIR`` or ``entrypoint TARGET``."""
    parser = argparse.ArgumentParser(prog="docker/stages.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="copy a stage's COPY sources under --root and print its RUN steps as bash")
    rp.add_argument("target")
    rp.add_argument("--root", type=Path, required=True, help="stands for / of the image")
    rp.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    rp.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    ep = sub.add_parser("entrypoint", help="print the target's ENTRYPOINT, one argument per line")
    ep.add_argument("target")
    ep.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    ns = parser.parse_args(argv)
    df = parse(ns.dockerfile)
    if ns.command == "replay":
        build_args = dict(a.split("=", 1) for a in ns.build_arg)
        sys.stdout.write(replay(df, ns.target, ns.root, build_args, context=ns.dockerfile.resolve().parent))
    else:
        print("\n".join(df.stage(ns.target).entrypoint() or []))


if __name__ == "__main__":
    main()
