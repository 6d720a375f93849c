"""The `llmgw` command: `llmgw up` runs a cluster on this machine; `llmgw ctl` talks to one."""

from __future__ import annotations

import argparse
import sys

from . import up as up_cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start a local cluster (NATS, services) until Ctrl-C")
    p_up.add_argument("--data-dir", default=".llmgw", help="where the local cluster keeps its state")
    p_up.add_argument("--port", type=int, default=4222, help="NATS client port")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "up":
        return up_cmd.run(args.data_dir, args.port)
    parser.error(f"unknown command {args.command}")
    return 2
