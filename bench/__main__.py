"""Run every benchmark, print the figures, and write them to BENCHMARKS.md with the machine they ran on."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench import auth, bus, durability, fleet, heartbeats, install, launcher, placement, scale

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


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="smaller runs (for a smoke check)")
    args = parser.parse_args()
    sections = []
    for module in (durability, auth, bus, install, placement, fleet, heartbeats, scale, launcher):
        name = module.__name__
        started = time.monotonic()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            sections.append(module.run(quick=args.quick))
        except Exception as exc:  # one broken benchmark must not lose the others' figures
            traceback.print_exc()
            sections.append(f"## {name}\n\nFailed in this run: {type(exc).__name__}: {exc}\n")
        print(f"bench: {name} took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (
        "# Benchmarks\n\n"
        f"Written by `just bench` on {when}, commit {commit.strip()}.\n"
        f"Machine: {machine()}.\n"
        "Each figure is compared with a baseline measured in the same run: "
        "the machines are shared and noisy.\n"
    )
    text = header + "\n" + "\n".join(sections)
    print(text)
    (ROOT / "BENCHMARKS.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
