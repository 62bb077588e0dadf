"""The seams of DESIGN.md, checked on the import graph with ast."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hlat"
NEURON = ("torch_xla", "neuronx_distributed", "torch_neuronx")
HYDRA = ("hydra", "omegaconf")


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_neuron_imports_only_in_the_neuron_backend() -> None:
    for path in modules():
        if path.name == "neuron.py" and path.parent.name == "backends":
            continue
        bad = {m for m in imports(path) if m.split(".")[0] in NEURON}
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_neuron_backend_imports_them_lazily() -> None:
    # torch_xla reads XLA_USE_BF16 & co. once, at import: the backend's setup sets them first, so no import of
    # torch_xla / neuronx_distributed may run when hlat.backends.neuron is imported (only inside functions).
    tree = ast.parse((SRC / "backends" / "neuron.py").read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
    top = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.split(".")[0] in NEURON}
    lazy = {m for m in imports(SRC / "backends" / "neuron.py") if m.split(".")[0] in NEURON}
    assert {"torch_xla.core.xla_model", "neuronx_distributed"} <= lazy  # the test sees the real imports


def test_hydra_only_in_run_config_and_cli() -> None:
    # launch.py starts the processes that call run.main; sweep.py and sweep_callback.py are the multirun's side of
    # the entry point (a Hydra callback, the job's decision before run.main).
    allowed = {"train/run.py", "cli.py", "train/launch.py", "track/sweep.py", "track/sweep_callback.py",
               "train/sweep_launcher.py",
               "config/__init__.py"}  # config/__init__.py: the ConfigStore
    for path in modules():
        if path.relative_to(SRC).as_posix() in allowed:
            continue
        bad = {m for m in imports(path) if m.split(".")[0] in HYDRA}
        assert not bad, f"{path.relative_to(SRC)} imports {bad}: nothing below run.py sees Hydra"


def test_model_is_backend_free() -> None:
    assert {m for m in imports(SRC / "model.py") if m.startswith("hlat")} <= {"hlat.config"}


def test_nothing_imports_run() -> None:
    for path in modules():
        if path.relative_to(SRC).as_posix() in {"train/run.py", "cli.py", "train/launch.py", "track/sweep.py"}:  # sweep.run_job wraps run.main for -m
            continue
        assert "hlat.train.run" not in imports(path), path
