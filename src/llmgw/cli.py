"""The `llmgw` command: `llmgw up` runs a cluster on this machine; `llmgw ctl` talks to one."""

from __future__ import annotations

import argparse
import sys

from llmgw_core.errors import LlmgwError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start a local cluster (NATS, placement, one node) until Ctrl-C")
    p_up.add_argument("--data-dir", default=".llmgw", help="where the local cluster keeps its state")
    p_up.add_argument("--port", type=int, default=4222, help="NATS client port")
    p_up.add_argument("--api-port", type=int, default=8080, help="placement's HTTP API port")
    p_fleet = sub.add_parser(
        "fleet", help="run thousands of simulated node agents against a cluster (scale tests)"
    )
    p_fleet.add_argument("--nodes", type=int, default=1000)
    p_fleet.add_argument("--gpus", type=int, default=8, help="simulated H100s per node")
    p_fleet.add_argument("--name", default="sim", help="node ids are <name>-00000, <name>-00001, …")
    p_fleet.add_argument("--prefix", default="llmgw", help="subject prefix of the cluster")
    p_fleet.add_argument(
        "--shard",
        default="0/1",
        help="I/N: run the I-th of N equal parts of the fleet (several processes share a big fleet)",
    )
    p_ctl = sub.add_parser("ctl", help="inspect a running cluster (LLMGW_NATS_URL)")
    p_ctl.add_argument("--prefix", default="llmgw", help="subject prefix of the cluster")
    ctl_sub = p_ctl.add_subparsers(dest="ctl", required=True)
    ctl_sub.add_parser("nodes", help="every node: alive, GPUs, engines, install progress")
    p_explain = ctl_sub.add_parser("explain", help="why a deployment is placed where it is, or not at all")
    p_explain.add_argument("deployment")
    p_deploy = ctl_sub.add_parser("deploy", help="create or change a deployment")
    p_deploy.add_argument("name")
    p_deploy.add_argument("--profile", required=True)
    p_deploy.add_argument("--replicas", type=int, default=1)
    p_deploy.add_argument("--pool", default="")
    p_deploy.add_argument("--strategy", choices=["binpack", "spread"], default="binpack")
    p_apply = ctl_sub.add_parser(
        "apply",
        help="write the engines, catalog and deployments of a server.yaml, replacing what the cluster has",
    )
    p_apply.add_argument("-f", "--file", required=True, help="server.yaml")
    p_delete = ctl_sub.add_parser("delete", help="delete a deployment: its replicas stop")
    p_delete.add_argument("kind", choices=["deployment"])
    p_delete.add_argument("name")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "up":
            from . import up

            return up.run(args.data_dir, args.port, args.api_port)
        from llmgw_core import telemetry

        if args.command == "fleet":
            from . import fleet

            telemetry.setup("llmgw-fleet")
            return fleet.main(args.nodes, args.gpus, args.name, args.prefix, shard=args.shard)

        from . import ctl

        telemetry.setup("llmgw-ctl", level="WARNING")
        return ctl.run(args)
    except LlmgwError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 2
