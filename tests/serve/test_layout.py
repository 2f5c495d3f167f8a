"""The serving package's layout: no import circle among its modules (imports inside functions included, those
only type checkers see left out), and the scheduler and the simulators stay model-free."""

import ast
import subprocess
import sys
from pathlib import Path

import ecru.serve

PACKAGE = Path(ecru.serve.__file__).parent


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path) -> set[str]:
    """The `ecru.serve` modules `path` imports at run time."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not _type_checking_only(node, parents):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in names if n.startswith("ecru.serve.") and _module_path(n).exists()}
        elif isinstance(node, ast.Import) and not _type_checking_only(node, parents):
            out |= {a.name for a in node.names if a.name.startswith("ecru.serve.")}
    return out


def _module_path(name: str) -> Path:
    return PACKAGE.joinpath(*name.split(".")[2:]).with_suffix(".py")


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, in every subpackage (`ecru.serve.sched.scheduler`, ...)."""
    modules = {
        ".".join(["ecru.serve", *p.relative_to(PACKAGE).with_suffix("").parts]): p
        for p in PACKAGE.rglob("*.py")
        if p.stem != "__init__"
    }
    return {name: imports(path) & set(modules) for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `edges`, or None (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finds_a_circle_and_only_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_serving_package():
    edges = graph()
    assert "ecru.serve.sched.scheduler" in edges and edges["ecru.serve.engine.request_engine"]  # it sees them
    assert "ecru.serve.sched.scheduler" in edges["ecru.serve.sim.simulator"]  # across subpackages too
    assert cycle(edges) is None, " -> ".join(cycle(edges))


def test_the_scheduler_and_the_simulators_are_torch_free():
    code = "import sys, ecru.serve.sched.scheduler, ecru.serve.sim.simulator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


LAYERS = ("sched", "engine", "sim", "predict", "entrypoints")
"""The subpackages, lowest first: each imports only its own, lower ones and the shared prompt modules."""


def test_each_subpackage_imports_only_lower_layers():
    def layer(module: str) -> int | None:
        part = module.split(".")[2]
        return LAYERS.index(part) if part in LAYERS else None  # None: serve.prompts, serve.workload

    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    upward = [
        f"{a} -> {b}"
        for a, bs in graph().items()
        for b in bs
        if layer(b) is not None and (layer(a) is None or layer(b) > layer(a))
    ]
    assert not upward, upward
