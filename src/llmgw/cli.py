"""The `llmgw` command: `llmgw up` runs a cluster on this machine; `llmgw ctl` talks to one;
`llmgw node onboard` installs a machine into one; `llmgw auth` makes its identities;
`llmgw gateway` serves its OpenAI endpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmgw_core.errors import LlmgwError

from ._bus_flags import add_bus_flags, bus_options
from ._parser import Parser, stdout_closed


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (building it imports nothing heavy): `main` parses with it and
    `llmgw completion` writes its script from it."""
    from llmgw_core.version import llmgw_version

    parser = Parser(prog="llmgw", description=__doc__)
    parser.add_argument("--version", action="version", version=f"llmgw {llmgw_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_up = sub.add_parser(
        "up",
        help="start a local cluster (NATS, placement, one node) until Ctrl-C",
        description="Run a whole cluster on this machine: nats-server, placement and its API, "
        "the gateway and simulated nodes, until Ctrl-C.",
    )
    p_up.add_argument(
        "--data-dir", default=".llmgw", help="where the local cluster keeps its state (default: %(default)s)"
    )
    p_up.add_argument("--port", type=int, default=4222, help="NATS client port (default: %(default)s)")
    p_up.add_argument(
        "--api-port",
        type=int,
        default=8080,
        help="placement's HTTP API and the cluster page (default: %(default)s)",
    )
    p_up.add_argument(
        "--insecure",
        action="store_true",
        help="run NATS and the API without authentication (anyone who reaches them controls the cluster)",
    )
    p_up.add_argument(
        "--gateway-port",
        type=int,
        default=8000,
        help="the gateway's port: the cluster's OpenAI endpoint (default: %(default)s)",
    )
    p_up.add_argument(
        "--nodes", type=int, default=1, help="how many simulated nodes to run here (default: %(default)s)"
    )
    p_up.add_argument(
        "--model",
        default="",
        metavar="SOURCE",
        help="run a real model with llama.cpp instead of the simulated one: hf://<org>/<repo>/<file>.gguf "
        "or a GGUF file on this machine (on its GPUs when it has them)",
    )
    p_up.add_argument(
        "--fresh",
        action="store_true",
        help="start from an empty store: remove what an earlier run left in the data dir's NATS store "
        "(deployments, nodes, keys); identities and staged models stay",
    )
    p_up.add_argument(
        "--engine-ports",
        default="28000-28999",
        metavar="LOW-HIGH",
        help="ports the engines may take, shared out among the nodes (default: %(default)s)",
    )
    from .engine_lock import add_parser as add_engines_parser

    add_engines_parser(sub)
    p_gateway = sub.add_parser(
        "gateway", help="serve one OpenAI-compatible endpoint for every deployment's ready replicas"
    )
    p_gateway.add_argument("--config", required=True, help="gateway.yaml")
    p_auth = sub.add_parser("auth", help="the cluster's identities (nkeys), their permissions and API tokens")
    auth_sub = p_auth.add_subparsers(dest="auth", required=True)
    p_init = auth_sub.add_parser(
        "init", help="write an nkey per identity, auth.conf for nats-server, and the API tokens"
    )
    p_init.add_argument("--dir", required=True, help="where to write them (keys already there are kept)")
    p_init.add_argument("--node", action="append", default=[], help="a node id (repeat for each node)")
    p_init.add_argument("--prefix", default="llmgw", help="subject prefix of the cluster")
    p_init.add_argument(
        "--fleet",
        action="store_true",
        help="also an identity for `llmgw fleet` (every node's rights: tests only)",
    )
    p_add = auth_sub.add_parser("add-node", help="give a new node its identity and rewrite auth.conf")
    p_add.add_argument("node")
    p_add.add_argument("--dir", required=True)
    p_remove = auth_sub.add_parser("remove-node", help="remove a node's identity and rewrite auth.conf")
    p_remove.add_argument("node")
    p_remove.add_argument("--dir", required=True)
    p_rotate = auth_sub.add_parser(
        "rotate",
        help="a new key for an identity (placement, ctl, node-<id>, …) or new API tokens (api-tokens)",
    )
    p_rotate.add_argument("identity")
    p_rotate.add_argument("--dir", required=True)
    p_fleet = sub.add_parser(
        "fleet", help="run thousands of simulated node agents against a cluster (scale tests)"
    )
    p_fleet.add_argument(
        "--nodes", type=int, default=1000, help="how many simulated nodes (default: %(default)s)"
    )
    p_fleet.add_argument(
        "--gpus", type=int, default=8, help="simulated H100s per node (default: %(default)s)"
    )
    p_fleet.add_argument(
        "--name", default="sim", help="node ids are <name>-00000, <name>-00001, … (default: %(default)s)"
    )
    p_fleet.add_argument(
        "--shard",
        default="0/1",
        help="I/N: run the I-th of N equal parts of the fleet (several processes share a big fleet; "
        "default: %(default)s)",
    )
    add_bus_flags(p_fleet)
    from .ctl._args import add_parser as add_ctl_parser

    add_ctl_parser(sub)
    _onboard_parser(sub)
    p_completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description='Print a completion script for SHELL: `eval "$(llmgw completion bash)"` in ~/.bashrc, '
        'or `llmgw completion zsh > "${fpath[1]}/_llmgw"`.',
    )
    from .completion import SHELLS

    p_completion.add_argument("shell", choices=SHELLS)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here (after --help and usage errors too), so that a reader that went away
            # is met by the handler below rather than by the interpreter's own flush at exit.
            sys.stdout.flush()
    except BrokenPipeError:
        return stdout_closed()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "completion":
            from .completion import script

            print(script(parser, args.shell), end="")
            return 0
        if args.command == "node":
            from . import onboard

            return onboard.run(args)
        if args.command == "up":
            from . import up

            return up.run(
                args.data_dir,
                args.port,
                args.api_port,
                insecure=args.insecure,
                gateway_port=args.gateway_port,
                nodes=args.nodes,
                engine_ports=up.parse_ports(args.engine_ports),
                model=args.model,
                fresh=args.fresh,
            )
        if args.command == "engines":
            from . import engine_lock

            return engine_lock.run(args)
        if args.command == "gateway":
            from llmgw_gateway.__main__ import run as run_gateway

            return run_gateway(args.config)
        if args.command == "auth":
            from . import auth

            return auth.main(args)
        from llmgw_core import telemetry

        if args.command == "fleet":
            from . import fleet

            telemetry.setup("llmgw-fleet")
            return fleet.main(args.nodes, args.gpus, args.name, bus_options(args), shard=args.shard)

        from . import ctl

        telemetry.setup("llmgw-ctl", level="WARNING")
        return ctl.run(args)
    except LlmgwError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 2


def _onboard_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p_node = sub.add_parser("node", help="manage the machines of a cluster")
    node_sub = p_node.add_subparsers(dest="node_command", required=True)
    p = node_sub.add_parser(
        "onboard",
        help="install llmgw on a machine over SSH, start its agents and wait for its first probe",
        description="Install llmgw on HOST over SSH from wheels built here (the host needs no package "
        "index), write agent.yaml and systemd units, start the agents and print the node's first probe.",
    )
    p.add_argument("host", help="the machine's name or address")
    p.add_argument("--user", help="SSH login (default: as ssh would)")
    p.add_argument("--identity", help="SSH private key file (default: your keys and agent)")
    p.add_argument("--port", type=int, default=22, help="SSH port")
    p.add_argument(
        "--known-hosts", help="known_hosts file that holds the host's key (default ~/.ssh/known_hosts)"
    )
    p.add_argument("--node", default="", help="node id (default: the host's short name)")
    p.add_argument("--install-dir", default="/opt/llmgw", help="where llmgw, its config and its state go")
    p.add_argument("--unit-dir", default="/etc/systemd/system", help="where the systemd units go")
    p.add_argument(
        "--start",
        choices=["systemd", "direct"],
        default="systemd",
        help="start the agents through systemd, or directly on a host without it",
    )
    p.add_argument("--python", default="python3", help="the host's Python 3.11+ interpreter")
    p.add_argument("--nats-url", default="", help="the bus as the node reaches it (default LLMGW_NATS_URL)")
    p.add_argument("--prefix", default="llmgw", help="subject prefix of the cluster")
    p.add_argument("--node-creds", help="NATS credentials file for the node (copied to it)")
    p.add_argument(
        "--mgmt-addr", default="", help="the node's management address (default: the one SSH reached)"
    )
    p.add_argument(
        "--model-path", action="append", default=[], help="weights directory on the node (repeatable)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the first probe")
