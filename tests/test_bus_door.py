"""The bus is the only door to NATS: no module outside `llmgw_core.bus` touches nats-py's
client (`nc`) or JetStream context (`js`). A raw call skips what the bus does on every
call (subjects bounded, a lost connection said once, bad messages dead-lettered)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUS = ROOT / "libs" / "llmgw_core" / "src" / "llmgw_core" / "bus"
TRANSPORT = {"nc", "js"}
PRIVATE_TRANSPORT = {"_nc", "_js"}


def _sources() -> list[Path]:
    trees = [ROOT / "src", ROOT / "libs" / "llmgw_core" / "src", *sorted((ROOT / "services").glob("*/src"))]
    return sorted(p for tree in trees for p in tree.rglob("*.py") if BUS not in p.parents)


def _names_a_bus(node: ast.expr) -> bool:
    """Whether an expression reads as a Bus (`bus`, `self.bus`, `self._bus`)."""
    if isinstance(node, ast.Name):
        return "bus" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "bus" in node.attr.lower()
    return False


def reaches(source: str, where: str) -> list[str]:
    """`file:line` for every reach past the bus in `source`: `.nc`/`.js` on anything but the
    `nats` package itself (`nats.js.errors` names an exception, no transport), and
    `._nc`/`._js` on a Bus."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        raw = node.attr in TRANSPORT and not (isinstance(node.value, ast.Name) and node.value.id == "nats")
        if raw or (node.attr in PRIVATE_TRANSPORT and _names_a_bus(node.value)):
            found.append((node.lineno, node.col_offset, f"{where}:{node.lineno}: .{node.attr}"))
    return [hit for _, _, hit in sorted(found)]


def test_no_module_outside_the_bus_touches_the_transport() -> None:
    sources = _sources()
    assert len(sources) > 50  # the walk found the tree
    found = [hit for path in sources for hit in reaches(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_guard_names_each_reach_and_leaves_the_rest() -> None:
    source = (
        "import nats.js.errors\n"
        "from nats.js import api\n"
        "async def f(bus, self):\n"
        "    await bus.nc.flush()\n"
        "    await self.bus.js.stream_info('x')\n"
        "    bus._nc.close()\n"
        "    self._nc.flush()\n"
        "    raise nats.js.errors.NotFoundError\n"
    )
    assert reaches(source, "m.py") == ["m.py:4: .nc", "m.py:5: .js", "m.py:6: ._nc"]
