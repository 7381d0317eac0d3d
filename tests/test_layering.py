"""The package's import layering: kernels -> ops -> losses -> config -> features -> checks and the run plan ->
forecast and patches -> entry points, with the shared utilities below them all. Every `trl_turbo` import (module level
or inside a function, read from the source with `ast`) must point to the same layer or a lower one, and no module may
reach itself through its imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_turbo"

# Top-level name under trl_turbo -> layer (imports may only point to the same layer or a lower one).
LAYERS: dict[str, int] = {
    "registry": 0, "versions": 0, "vllm_contract": 0, "distributed": 0, "host_memory": 0, "device_memory": 0,
    "families": 0,
    "kernels": 1,
    "ops": 2,
    "losses": 3,
    "config": 4,
    "grpo": 5, "offload": 5, "vllm": 5, "tasks": 5, "sharding": 5,
    "checks": 6, "run_plan": 6,
    "planning": 7, "patches": 7,
    "__init__": 8, "cli": 8, "_launch": 8, "bench": 8, "testing": 8,
}


def _module_name(path: Path, package: Path) -> str:
    parts = ["trl_turbo", *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the trl_turbo modules it imports (a `from x import name` counts as importing `x.name` when that is a
    module, else `x`)."""
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "trl_turbo":
                    continue
                submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
                targets |= submodules or {source}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.split(".")[0] == "trl_turbo"}
        graph[name] = {target for target in targets if target != name}
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    if top not in LAYERS:
        raise AssertionError(f"{module}: no layer declared for trl_turbo.{top} (add it to LAYERS)")
    return LAYERS[top]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    for module in graph:
        _layer(module)  # every module has a declared layer
    return sorted(f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)})"
                  for source, targets in graph.items() for target in targets if _layer(target) > _layer(source))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_points_up_a_layer():
    assert upward_imports(import_graph()) == []


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_checks_fail_on_an_upward_import_and_a_circle(tmp_path):
    package = tmp_path / "trl_turbo"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "fused.py").write_text("def f():\n    from ..patches import seam\n")
    (package / "patches").mkdir()
    (package / "patches" / "__init__.py").write_text("")
    (package / "patches" / "seam.py").write_text("from ..ops import fused\n")
    graph = import_graph(package)
    assert upward_imports(graph) == ["trl_turbo.ops.fused (layer 2) imports trl_turbo.patches.seam (layer 7)"]
    assert cycles(graph) == [["trl_turbo.ops.fused", "trl_turbo.patches.seam"]]
    (package / "mystery.py").write_text("")
    with pytest.raises(AssertionError, match="no layer declared"):
        upward_imports(import_graph(package))
