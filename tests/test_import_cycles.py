"""No import cycle in llmgw's own packages, and no placement module over MODULE_LINES lines.

The import graph is read from the source (the AST), not from `sys.modules`: every
import counts, at module level, under `if TYPE_CHECKING:` and inside a function. A
type-only cycle costs nothing at run time, but it ties two modules so that neither can
be read, tested or moved alone; a Protocol or the shared types in a leaf module breaks it.
"""

from __future__ import annotations

import ast
import functools
import tempfile
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each first-party package and the folder that holds it.
PACKAGES = {
    "llmgw_core": ROOT / "libs" / "llmgw_core" / "src" / "llmgw_core",
    "llmgw_installer": ROOT / "services" / "installer" / "src" / "llmgw_installer",
    "llmgw_launcher": ROOT / "services" / "launcher" / "src" / "llmgw_launcher",
    "llmgw_placement": ROOT / "services" / "placement" / "src" / "llmgw_placement",
    "llmgw_gateway": ROOT / "services" / "gateway" / "src" / "llmgw_gateway",
    "llmgw": ROOT / "src" / "llmgw",
}
# The most lines a placement module may have: one concern each.
MODULE_LINES = 450
SIZED = "llmgw_placement"


# Problems another change is fixing now: the exact line `problems()` gives -> what fixes it.
def modules() -> dict[str, Path]:
    """Every first-party module by dotted name (a package by its own name, for its `__init__`)."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` of a name that is no module: the longest prefix that is one.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # An explicit stack: (module, its successors still to walk).
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    out.append(sorted(members))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    return sorted(out)


def cycle_through(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest cycle from `start` back to it within one component (breadth first)."""
    came: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(edges[node] & members):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if succ not in came:
                came[succ] = node
                queue.append(succ)
    raise AssertionError(f"{start} is in a component but on no cycle")  # cannot happen


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """One line per import cycle: for every module of every component, the shortest cycle through
    it, each cycle said once, from its first module in name order."""
    out: set[str] = set()
    for members in components(edges):
        for start in members:
            path = cycle_through(start, set(members), edges)[:-1]
            first = path.index(min(path))
            path = path[first:] + path[:first]
            out.add("cycle: " + " -> ".join([*path, path[0]]))
    return sorted(out)


def too_long() -> list[str]:
    out = []
    for name, path in sorted(modules().items()):
        if name.split(".")[0] == SIZED:
            lines = len(path.read_text().splitlines())
            if lines > MODULE_LINES:
                out.append(f"too long: {name} ({lines} lines > {MODULE_LINES})")
    return out


def problems() -> list[str]:
    return cycles(graph()) + too_long()


def test_the_graph_sees_every_kind_of_import() -> None:
    """A cycle that exists only under TYPE_CHECKING or inside a function is still one."""
    edges = graph()
    # Module level, relative: the placement service builds its controller.
    assert "llmgw_placement.controller" in edges["llmgw_placement.service"]
    # `from . import x` of a submodule, and `import a.b` of a package: edges to the modules named.
    assert "llmgw_core.bus.facade" in edges["llmgw_core.bus"]
    # A toy graph: a three-module cycle and a two-module one, each said once.
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert components(toy) == [["a", "b", "c"], ["d", "e"]]
    assert cycles(toy) == ["cycle: a -> b -> c -> a", "cycle: d -> e -> d"]
    # Two cycles in one component: each named.
    toy = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}
    assert cycles(toy) == ["cycle: a -> b -> a", "cycle: a -> c -> a"]


def test_type_checking_and_function_imports_count() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pkg"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "a.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
        )
        (package / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
        known = {"pkg", "pkg.a", "pkg.b"}
        assert imports("pkg.a", package / "a.py", known) == {"pkg.b"}
        assert imports("pkg.b", package / "b.py", known) == {"pkg.a"}


def test_no_import_cycle_and_no_placement_module_over_450_lines() -> None:
    """Every cycle and every oversize module, in one message."""
    found = problems()
    assert not found, "import cycles and oversize placement modules:\n" + "\n".join(f"  {p}" for p in found)
