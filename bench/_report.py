"""What every benchmark's report needs: the repository's root, the machine it ran on, and one
section of BENCHMARKS.md replaced. Here, not in `bench/__main__.py`, so that a benchmark run on
its own (`python -m bench.partitions`) and `python -m bench`, which imports every benchmark,
both import it without importing each other."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{system}, {os.cpu_count()} cores ({cpu}), {mem}, Python {platform.python_version()}"


def replace_section(text: str, title: str, section: str) -> str:
    """`text` with the section headed `title` (up to the next `## ` heading) replaced by `section`,
    or `section` added at the end where there is none."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == title), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = "".join(lines[end:])
    return "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")


def revision() -> str:
    """The code measured: `commit abc1234`, and `and the working tree` where it differs."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    ).stdout.strip()
    return f"commit {commit}" + (" and the working tree" if dirty else "") if commit else "no commit known"


def write_alone(section: str, command: str) -> None:
    """Replace `section`'s part of BENCHMARKS.md, stamped with when, the code and the machine
    it was measured on by `command` (a benchmark run on its own)."""
    at = revision()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    title, _, body = section.partition("\n")
    stamp = f"Run on its own by `{command}` on {when}, {at}, on {machine()}."
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else ""
    path.write_text(replace_section(text, title, f"{title}\n\n{stamp}\n{body}"))
