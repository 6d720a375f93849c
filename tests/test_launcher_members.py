"""The launcher stays a set of small members: no class in llmgw_launcher with more than
MAX_ATTRIBUTES instance attributes, and no module over MODULE_LINES lines.

An object that holds every concern of a service (the launcher once had 27 attributes: the
port allocator, the status audit, the logs server, the metrics and the evictions in one)
cannot be read, tested or changed one concern at a time. Each concern is a member in a
module named for it, and a shard's start is a row of hooks (`llmgw_launcher.start`).

Attributes are read from the source (the AST): every `self.NAME` assigned anywhere in a
class's body, and every name annotated at class level (a dataclass's fields, a Protocol's
attributes), less `ClassVar`s.
"""

from __future__ import annotations

import ast
from pathlib import Path

from llmgw_launcher import start

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "services" / "launcher" / "src" / "llmgw_launcher"
MAX_ATTRIBUTES = 25
MODULE_LINES = 600
# The weights store and its peer exchange are sized on their own terms, not by this rule.
UNSIZED = {"weights.py", "peers.py"}


def _is_class_var(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(target, ast.Name) and target.id == "ClassVar") or (
        isinstance(target, ast.Attribute) and target.attr == "ClassVar"
    )


def attributes(cls: ast.ClassDef) -> set[str]:
    """The instance attributes of `cls`: class-level annotations and `self.X = …` anywhere in it."""
    names: set[str] = set()
    for stmt in cls.body:
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and not _is_class_var(stmt.annotation)
        ):
            names.add(stmt.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    names.add(part.attr)
    return names


def oversized(source: str, where: str) -> list[str]:
    """Each class of `source` with more than MAX_ATTRIBUTES attributes, in words."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            names = attributes(node)
            if len(names) > MAX_ATTRIBUTES:
                found.append(
                    f"{where}: class {node.name} has {len(names)} attributes (at most {MAX_ATTRIBUTES}): "
                    f"{', '.join(sorted(names))}; give a concern its own member"
                )
    return found


def test_no_launcher_class_has_more_than_25_attributes() -> None:
    problems = []
    for path in sorted(PACKAGE.glob("*.py")):
        problems += oversized(path.read_text(), path.name)
    assert problems == []


def test_no_launcher_module_is_over_600_lines() -> None:
    long = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name not in UNSIZED:
            lines = len(path.read_text().splitlines())
            if lines > MODULE_LINES:
                long[path.name] = lines
    assert long == {}


def test_the_count_sees_every_way_an_attribute_is_set() -> None:
    """The guard itself: assignments anywhere on self, tuples, augmented and annotated ones, and
    class-level fields count; ClassVars, locals and other objects' attributes do not."""
    fields = "\n".join(f"    f{i}: int = 0" for i in range(20))
    source = f"""
from dataclasses import dataclass
from typing import ClassVar

@dataclass
class Big:
{fields}
    shared: ClassVar[int] = 0

    def later(self, other) -> None:
        self.a = 1
        self.b, (self.c, self.d) = 2, (3, 4)
        self.e += 1
        self.g: int = 5
        local = 6
        other.h = 7
"""
    [problem] = oversized(source, "big.py")
    assert problem.startswith("big.py: class Big has 26 attributes (at most 25): a, b, c, d, e, f0, f1, ")
    assert "shared" not in problem
    assert ", h," not in problem
    assert "local" not in problem
    assert oversized(source.replace("        self.g: int = 5\n", ""), "big.py") == []


def test_a_shard_starts_through_its_hooks_in_order() -> None:
    assert [hook.name for hook in start.START] == [
        "validate",
        "model",
        "weights",
        "adapters",
        "ports",
        "spawn",
        "health",
    ]


def test_weights_progress_is_what_the_audit_expects_in_the_bucket(tmp_path: Path) -> None:
    """Regression: a shard's staging progress went to the status bucket, but its runner still
    held the first `waiting` status as its own, so the status audit took the bucket's newer words
    for another writer's and wrote the stale status back (an event and a warning with it)."""
    from llmgw_core.engines import default_registry
    from llmgw_core.events import ShardStatus
    from llmgw_launcher.audit import audit
    from llmgw_launcher.context import Context
    from llmgw_launcher.health import HealthProber
    from llmgw_launcher.ports import PortPool
    from llmgw_launcher.records import Records, RecordWriter
    from llmgw_launcher.runner import ShardRunner
    from tests.launcher_support import shard, sim_profile

    loud: list[ShardStatus] = []
    quiet: list[ShardStatus] = []
    ctx = Context(
        node="node-a",
        state_dir=tmp_path,
        registry=default_registry(),
        gpus=[],
        records=RecordWriter(Records(tmp_path)),
        publish=loud.append,
        prober=HealthProber(),
        ports=PortPool((41000, 41010), "127.0.0.1", "node-a"),
        publish_quietly=quiet.append,
    )
    runner = ShardRunner("node-a.s1", shard("node-a", "s1", sim_profile()), ctx)
    runner.set_state("waiting", "staging hf://org/m: 0 of 2 files")
    runner.progress("waiting", "staging hf://org/m: 1 of 2 files")
    assert [s.reason for s in loud] == ["staging hf://org/m: 0 of 2 files"]
    [stored] = quiet
    assert stored.reason == "staging hf://org/m: 1 of 2 files"
    assert stored.at == loud[0].at, "progress dates the state, which has not changed"
    assert runner.status == stored
    # Two audits in a row find the bucket as the runner last published it: nothing to correct.
    mine = {"node-a.s1": runner.status}
    fix, suspects = audit({"node-a.s1": stored}, mine, {})
    assert (bool(fix), suspects) == (False, {})
