"""Run every benchmark, print the figures, and write them to BENCHMARKS.md with the machine they ran on."""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from bench import (
    auth,
    autoscale,
    bus,
    continuation,
    durability,
    fit,
    fleet,
    gateway,
    heartbeats,
    install,
    launcher,
    partitions,
    placement,
    routing,
    routing_vllm,
    scale,
    weights,
)
from bench._report import ROOT, machine, replace_section, revision

MODULES = (
    durability,
    auth,
    bus,
    install,
    placement,
    fleet,
    heartbeats,
    scale,
    launcher,
    fit,
    weights,
    gateway,
    routing,
    routing_vllm,
    autoscale,
    continuation,
    partitions,
)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="smaller runs (for a smoke check)")
    parser.add_argument(
        "--only",
        action="append",
        choices=[m.__name__.removeprefix("bench.") for m in MODULES],
        help="run this section alone (repeatable) and replace only its part of BENCHMARKS.md, "
        "stamped with its own date, commit and machine",
    )
    args = parser.parse_args()
    modules = [m for m in MODULES if not args.only or m.__name__.removeprefix("bench.") in args.only]
    sections = []
    for module in modules:
        name = module.__name__
        started = time.monotonic()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            sections.append(module.run(quick=args.quick))
        except Exception as exc:  # one broken benchmark must not lose the others' figures
            traceback.print_exc()
            sections.append(f"## {name}\n\nFailed in this run: {type(exc).__name__}: {exc}\n")
        print(f"bench: {name} took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    commit = revision()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path = ROOT / "BENCHMARKS.md"
    if args.only:
        text = path.read_text() if path.exists() else ""
        for section in sections:
            title, _, body = section.partition("\n")
            stamp = (
                f"Run on its own by `python -m bench --only` on {when}, {commit}, on {machine()}; "
                "the sections without such a line come from the run named at the top."
            )
            text = replace_section(text, title, f"{title}\n\n{stamp}\n{body}")
        print("\n".join(sections))
        path.write_text(text)
        return 0
    header = (
        "# Benchmarks\n\n"
        f"Written by `just bench` on {when}, {commit}.\n"
        f"Machine: {machine()}.\n"
        "Each figure is compared with a baseline measured in the same run: "
        "the machines are shared and noisy.\n"
    )
    text = header + "\n" + "\n".join(sections)
    print(text)
    kept = kept_sections(path.read_text() if path.exists() else "", sections)
    path.write_text(text.rstrip("\n") + "\n" + "".join("\n" + s for s in kept))
    return 0


KEPT = "Not written by the run named at the top: kept from an earlier BENCHMARKS.md."


def kept_sections(old: str, written: list[str]) -> list[str]:
    """The sections of the previous BENCHMARKS.md that no benchmark of this run wrote (figures
    measured by hand, before/after comparisons): a full run must not lose them."""
    titles = {section.partition("\n")[0] for section in written}
    kept = []
    for chunk in ("\n" + old).split("\n## ")[1:]:
        section = "## " + chunk.rstrip("\n") + "\n"
        title, _, body = section.partition("\n")
        if title in titles:
            continue
        if KEPT not in body:
            body = f"\n{KEPT}\n{body}"
        kept.append(f"{title}\n{body}")
    return kept


if __name__ == "__main__":
    sys.exit(main())
