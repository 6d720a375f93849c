"""The benchmarks' report: `python -m bench` lists every benchmark that writes a section
(partitions and continuation included, importable without importing `bench.__main__` back),
and a section run alone replaces its own part of BENCHMARKS.md, nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench._report import replace_section

ROOT = Path(__file__).parent.parent


def test_bench_lists_partitions_and_continuation_and_imports_them_once() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "continuation" in done.stdout, done.stdout
    assert "partitions" in done.stdout, done.stdout
    # A benchmark importing `bench.__main__` while `python -m bench` runs would import it a
    # second time, under its own name: each module must reach the report through bench._report.
    for module in ("partitions", "continuation"):
        text = (ROOT / "bench" / f"{module}.py").read_text()
        assert "bench.__main__" not in text, module


def test_a_section_replaces_its_own_part_and_keeps_the_rest() -> None:
    text = "# Benchmarks\n\n## A\n\nold a\n\n## B\n\nb\n"
    new_a = "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nb\n"
    assert replace_section(text, "## A", "## A\n\nnew a\n") == new_a
    new_b = "# Benchmarks\n\n## A\n\nold a\n\n## B\n\nnew b\n"
    assert replace_section(text, "## B", "## B\n\nnew b\n") == new_b
    assert replace_section(text, "## C", "## C\n\nc\n") == text + "\n## C\n\nc\n"
