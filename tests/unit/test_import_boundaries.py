"""The seams of the design (ARCHITECTURE.md, "The layers"), checked on the import graph with ast."""

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


HYDRA_ALLOWED = {
    "cli/__init__.py",
    "config/__init__.py",
    "config/compose.py",
    "config/resolvers.py",  # ConfigStore, compose, resolvers
    "train/entry.py",  # the composed config in, converted once (to_run_config): below it, only RunConfig
    "sweep/job.py",
    "sweep/callback.py",
    "sweep/launcher.py",
    "track/sweep.py",  # the multirun
}
"""The modules that see Hydra / OmegaConf: the entry points, the config layer, and the multirun's side of them."""


def test_hydra_only_at_the_entry_points_and_the_config_layer() -> None:
    for path in modules():
        if path.relative_to(SRC).as_posix() in HYDRA_ALLOWED:
            continue
        bad = {m for m in imports(path) if m.split(".")[0] in HYDRA}
        assert not bad, f"{path.relative_to(SRC)} imports {bad}: below the entry points nothing sees Hydra"


def test_model_is_backend_free() -> None:
    # The information-leak experiment's attention is imported only when model.mask_leak asks for it.
    allowed = {"hlat.config", "hlat.attention", "hlat.experiments.information_leak"}
    assert {m for m in imports(SRC / "model.py") if m.startswith("hlat")} <= allowed


def test_only_the_entry_imports_run() -> None:
    for path in modules():
        if path.relative_to(SRC).as_posix() == "train/entry.py":  # entry -> run.main, in or out of process
            continue
        assert "hlat.train.run" not in imports(path), path


# ------------------------------------------------------------------------------------ the import graph and its layers

LAYERS: tuple[tuple[str, ...], ...] = (
    ("hlat.config",),
    (
        "hlat",
        "hlat.model",
        "hlat.attention",
        "hlat.experiments",
        "hlat.parallel",
        "hlat.norms",
        "hlat.optim",
        "hlat.sizing",
        "hlat.layouts",
        "hlat.safe_load",
        "hlat.host",
        "hlat.logs",
        "hlat.state",
        "hlat.tally",
    ),
    ("hlat.launch",),
    ("hlat.plan",),
    ("hlat.data", "hlat.backends", "hlat.track"),
    ("hlat.checkpoint",),
    ("hlat.health",),
    ("hlat.train", "hlat.sweep"),
    ("hlat.eval", "hlat.deploy", "hlat.cli", "hlat.plan.command", "hlat.plan.graphs_command"),
)
"""Bottom to top: the config layer; the core (model, layouts, norms, ...); launching (torch elastic supervision,
the rendezvous, restart attempts, preemption: the backends, checkpoints, health checks and the trainer use them); the
planner; data, backends and tracking; checkpoints (their files, manifests, weights and the Hugging Face layout:
training and evaluation both read them); the health checks the trainer runs; training and the multirun's jobs,
callback and launcher; the commands (evaluation, deployment, the command line and ``hlat doctor``, ``hlat plan``). A
module belongs to the layer of its longest listed prefix (a module directly in ``hlat/`` is listed by its own name);
imports go down or sideways, never up."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the hlat modules it imports, at the top or inside a function (``from a import b``: ``a.b`` when
    ``b`` is a module, else ``a``), relative imports resolved."""
    names = {module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in names else base)
        graph[name] = {_owner(t, names) for t in targets if _owner(t, names)} - {name}
    return graph


def _owner(target: str, names: dict[str, Path]) -> str | None:
    """The hlat module that ``target`` (a module, or a name inside one) is, or None outside hlat."""
    while target and target not in names:
        target = target.rpartition(".")[0]
    return target or None


def layer(name: str) -> int:
    best = max(
        (
            (len(p), i)
            for i, prefixes in enumerate(LAYERS)
            for p in prefixes
            if name == p or (p != "hlat" and name.startswith(p + "."))
        ),
        default=None,
    )
    assert best is not None, f"{name} is in no layer: add it to LAYERS (and its package's docstring)"
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()  # the lazy ones are the ones that used to close circles
    assert "hlat.plan.paper" in graph["hlat.plan.command"]  # `hlat plan --paper`, imported when asked for
    assert "hlat.train.entry" in graph["hlat.cli"]  # `hlat train`, imported once the config composed
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_eval_reads_checkpoints_without_the_trainer() -> None:
    # Evaluation sits above training in the layers, but reads checkpoints through hlat.checkpoint only: a
    # checkpoint's reader must not need the trainer (nor import what it imports).
    graph = import_graph()
    bad = sorted(
        f"{a} imports {b}" for a in graph if a.startswith("hlat.eval") for b in graph[a] if b.startswith("hlat.train")
    )
    assert not bad, bad


def test_launching_imports_only_the_config_and_the_core() -> None:
    # The supervisor runs the worker function its caller hands it (the trainer, hlat doctor's checks): hlat.launch
    # never imports them, so the backends, checkpoints and health checks below the trainer can use its pieces.
    graph = import_graph()
    bad = sorted(
        f"{a} imports {b}"
        for a in graph
        if a.startswith("hlat.launch")
        for b in graph[a]
        if not b.startswith("hlat.launch") and layer(b) > layer("hlat")
    )
    assert not bad, bad


def test_no_import_circle() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other, directly or around a circle: " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_imports_only_go_down_the_layers() -> None:
    graph = import_graph()
    upward = sorted(
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a in graph for b in graph[a] if layer(b) > layer(a)
    )
    assert not upward, "imports up the layers:\n" + "\n".join(upward)
