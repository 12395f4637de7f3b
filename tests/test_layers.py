"""The package's layers: imports go only downward, and no module imports itself in a circle.

docs/ARCHITECTURE.md draws the layers; this reads every import of every module (module level,
functions, TYPE_CHECKING blocks alike) and fails on one that reaches up or sideways.
"""

from __future__ import annotations

import ast
import pathlib

import leakcheck

PACKAGE = pathlib.Path(leakcheck.__file__).parent

# Bottom to top; a module may import from its own layer and from layers of a lower rank.
RANK = {
    "core": 0,
    "observe": 1,
    "judge": 2,
    "track": 3,
    "worker": 3,
    "adapters": 4,
    "commands": 5,
    "integrations": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("leakcheck.")]


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_layer() -> None:
    loose = [
        _module_name(path)
        for path in _modules()
        if _layer(_module_name(path)) is None and path.parent != PACKAGE
    ]
    top_level = {path.name for path in PACKAGE.glob("*.py")}
    assert loose == []
    assert top_level == {"__init__.py", "__main__.py"}


def test_imports_only_go_downward() -> None:
    upward: list[str] = []
    for path in _modules():
        module = _module_name(path)
        layer = _layer(module)
        if layer is None:
            continue
        for line, name in _imports(path):
            other = _layer(name)
            if other is not None and other != layer and RANK[other] >= RANK[layer]:
                upward.append(f"{module}:{line} imports {name}")
    assert upward == []


def test_no_import_circles() -> None:
    modules = {_module_name(path): path for path in _modules()}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _line, target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "leakcheck":
                edges[name].add(target)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    assert circles == []
