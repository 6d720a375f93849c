"""Run every benchmark, print the figures, and write them to BENCHMARKS.md with the machine they ran on."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
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
    sections = [
        durability.run(quick=args.quick),
        auth.run(quick=args.quick),
        bus.run(quick=args.quick),
        install.run(quick=args.quick),
        placement.run(quick=args.quick),
        fleet.run(quick=args.quick),
        heartbeats.run(quick=args.quick),
        scale.run(quick=args.quick),
        launcher.run(quick=args.quick),
    ]
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
