"""`llmgw ctl`'s command line (argparse only: building it imports nothing heavy)."""

from __future__ import annotations

import argparse
from typing import Any

from .._bus_flags import add_bus_flags

EXAMPLES = """\
examples:
  llmgw ctl get nodes                       every node: alive, GPUs, engines, install progress
  llmgw ctl get replicas -o json            replica records, for scripts
  llmgw ctl get deploy -o name              deployment/chat, one a line (kinds: no, deploy, rs, …)
  llmgw ctl describe profile tiny           a profile of the catalog and the deployments using it
  llmgw ctl get shards --watch              the table, then each changed row as it changes
  llmgw ctl describe deployment chat        desired vs ready, replicas, last failure, refusal, events
  llmgw ctl deploy chat --profile tiny --replicas 2
  llmgw ctl deploy chat --profile tiny --min-replicas 0 --max-replicas 4   follows demand
  llmgw ctl scale chat --replicas 5
  llmgw ctl logs node-1/chat-r0-0 --tail 50 --follow
  llmgw ctl events --deployment chat --follow
  llmgw ctl apply -f server.yaml --dry-run   what would change, written nowhere
  llmgw ctl delete deployment chat
  llmgw ctl drain gpu-3 --reason "disk swap"
  llmgw ctl keys create team-a --models chat --rpm 60 --tpm 100000 --expires 30d
  llmgw ctl usage --by key --since 24h -o json
  llmgw ctl backup -o llmgw-backup.json     the desired state (catalog, deployments, keys, ...) to a file
  llmgw ctl restore -f llmgw-backup.json    written back after a lost NATS store

exit codes: 0 done, 2 usage, 3 not found, 4 refused, 5 cannot reach NATS (3 s) or the launcher asked;
141 when stdout's reader went away (`| head`).
The connection: --nats-url or LLMGW_NATS_URL, --nkey or LLMGW_NATS_NKEY. Output fields: docs/ctl.md.
"""

# Every name a kind answers to, as kubectl's habits have them (`get no`, `get deploy`, `get rs`).
KINDS = {
    "nodes": "node",
    "node": "node",
    "no": "node",
    "deployments": "deployment",
    "deployment": "deployment",
    "deploy": "deployment",
    "replicas": "replica",
    "replica": "replica",
    "rs": "replica",
    "shards": "shard",
    "shard": "shard",
    "profiles": "profile",
    "profile": "profile",
    "adapters": "adapter",
    "adapter": "adapter",
}
DESCRIBED = {
    name: kind for name, kind in KINDS.items() if kind in ("deployment", "node", "profile", "adapter")
}
OUTPUTS = ["wide", "json", "yaml", "name"]


def names(action: argparse.Action, kind: str) -> argparse.Action:
    """Completion offers the names of `kind` here, as `llmgw ctl get KIND -o name` lists them
    (`@KIND`: of the kind that the KIND argument before it named). See `llmgw.completion`."""
    action.completes = kind  # type: ignore[attr-defined]
    return action


def add_parser(sub: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    p_ctl: argparse.ArgumentParser = sub.add_parser(
        "ctl",
        help="inspect and change a running cluster (LLMGW_NATS_URL, LLMGW_NATS_NKEY)",
        description="Read the cluster's state from where it is kept and change what the operator owns.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from llmgw_core.version import llmgw_version

    p_ctl.add_argument("--version", action="version", version=f"llmgw {llmgw_version()}")
    add_bus_flags(p_ctl)
    common = argparse.ArgumentParser(add_help=False)
    add_bus_flags(common, suppress=True)
    ctl_sub = p_ctl.add_subparsers(dest="ctl", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, **kw: object) -> argparse.ArgumentParser:
        return ctl_sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            parents=[common],
            epilog=EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kw,  # type: ignore[arg-type]
        )

    p_get = add("get", "list nodes, deployments, replicas, shards or profiles (one, with NAME)")
    p_get.add_argument("kind", choices=KINDS, metavar="KIND", help=f"one of {', '.join(KINDS)}")
    names(
        p_get.add_argument(
            "name",
            metavar="NAME",
            nargs="?",
            default="",
            help="one of them: a replica DEPLOYMENT/rN, a shard NODE/SHARD (or SHARD); "
            "a deployment's name lists its replicas or shards",
        ),
        "@KIND",
    )
    p_get.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="",
        help="wide (more columns), json, yaml, or name (KIND/NAME a line); default: a table",
    )
    p_get.add_argument("-w", "--watch", action="store_true", help="then print each row as it changes")
    p_describe = add("describe", "the full story of a deployment, a node or a profile")
    p_describe.add_argument("kind", choices=DESCRIBED, metavar="KIND", help=f"one of {', '.join(DESCRIBED)}")
    names(p_describe.add_argument("name"), "@KIND")
    add("nodes", "every node: alive, GPUs, engines, install progress (= get nodes)")
    p_explain = add("explain", "why a deployment stands as it does: ready of desired, every node's reason")
    names(p_explain.add_argument("deployment"), "deployment")
    p_deploy = add("deploy", "create or change a deployment")
    p_deploy.add_argument("name")
    names(p_deploy.add_argument("--profile", required=True, help="a profile of the catalog"), "profile")
    p_deploy.add_argument(
        "--replicas", type=int, default=1, help="how many copies of the model serve (default: %(default)s)"
    )
    p_deploy.add_argument(
        "--pool", default="", help="only the nodes of this pool (server.yaml's `pools:`; default: any node)"
    )
    p_deploy.add_argument(
        "--strategy",
        choices=["binpack", "spread"],
        default="binpack",
        help="binpack fills the fullest nodes first; spread prefers the nodes with the fewest of "
        "this deployment's replicas (default: %(default)s)",
    )
    p_deploy.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="follow demand, never below this many replicas (0: scale to zero); needs --max-replicas",
    )
    p_deploy.add_argument(
        "--max-replicas", type=int, default=None, help="follow demand, never above this many replicas"
    )
    p_deploy.add_argument(
        "--target-in-flight",
        type=float,
        default=None,
        help="requests in flight per replica the count aims at (default: 4)",
    )
    p_deploy.add_argument(
        "--scale-down-after",
        type=float,
        default=None,
        metavar="S",
        help="seconds demand stays low before a replica is stopped (default: 300)",
    )
    p_scale = add("scale", "change a deployment's replica count")
    names(p_scale.add_argument("name", help="the deployment"), "deployment")
    p_scale.add_argument("--replicas", type=int, required=True, help="the new replica count")
    p_apply = add(
        "apply",
        "write the sections a server.yaml names (engines, catalog, deployments); "
        "a section it omits is left as it is",
    )
    p_apply.add_argument("-f", "--file", required=True, help="server.yaml")
    p_apply.add_argument(
        "--dry-run", action="store_true", help="say what would be added, changed and deleted; write nothing"
    )
    p_apply.add_argument(
        "--prune",
        action="store_true",
        help="delete the profiles and deployments a named section omits (without it nothing is deleted)",
    )
    p_backup = add(
        "backup",
        "write the desired state (engines, catalog, deployments, keys as hashes, node intents) to a file",
    )
    p_backup.add_argument("-o", "--output", dest="file", required=True, help="the backup file to write")
    p_restore = add(
        "restore",
        "write a backup's desired state back into the store (after a lost NATS store); "
        "records stored since the backup are left unless --force",
    )
    p_restore.add_argument("-f", "--file", required=True, help="a file `llmgw ctl backup` wrote")
    p_restore.add_argument(
        "--force", action="store_true", help="write over records stored after the backup was taken"
    )
    p_delete = add("delete", "delete a deployment (its replicas stop), or forget a lost node")
    p_delete.add_argument("kind", choices=["deployment", "node", "adapter"])
    names(p_delete.add_argument("name"), "@KIND")
    for verb, text in (
        ("cordon", "keep new replicas off a node; its replicas keep running"),
        (
            "drain",
            "cordon a node and place its replicas elsewhere, each old one stopped once the new is ready",
        ),
    ):
        p_node = add(verb, text)
        names(p_node.add_argument("node"), "node")
        p_node.add_argument("--reason", default="", help="why, quoted by every refusal on the node")
    names(
        add("uncordon", "let new replicas go to a cordoned or drained node again").add_argument("node"),
        "node",
    )
    p_logs = add("logs", "a shard's log lines, from its node's launcher")
    names(
        p_logs.add_argument("shard", help="a shard: NODE/SHARD as `get shards` names it, or SHARD"), "shard"
    )
    p_logs.add_argument("--tail", type=int, default=100, help="the last N lines (0: all that fit 1 MB)")
    p_logs.add_argument("-f", "--follow", action="store_true", help="then print new lines as they come")
    p_logs.add_argument("--process", default="", help="one of the shard's processes (default: the engine)")
    p_events = add("events", "the cluster's events, oldest first")
    names(p_events.add_argument("--deployment", default="", help="only this deployment's"), "deployment")
    names(p_events.add_argument("--node", default="", help="only this node's"), "node")
    p_events.add_argument("-f", "--follow", action="store_true", help="then print new events as they come")
    p_events.add_argument("-o", "--output", choices=["json"], default="", help="one JSON object a line")
    p_keys = add("keys", "client API keys the gateways accept: create, list, describe, revoke")
    keys_sub = p_keys.add_subparsers(dest="keys", required=True, metavar="ACTION")

    def add_key(name: str, help_text: str) -> argparse.ArgumentParser:
        p = keys_sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        p.add_argument(
            "-o", "--output", choices=["json", "yaml"] + (["name"] if name == "list" else []), default=""
        )
        return p

    p_create = add_key("create", "make a key; its secret is printed once (with -o json, in `secret`)")
    p_create.add_argument("name")
    p_create.add_argument("--models", default="", help="model names it may call, a,b (default: every model)")
    p_create.add_argument("--rpm", type=int, default=0, help="requests per minute (default: no limit)")
    p_create.add_argument(
        "--tpm", type=int, default=0, help="prompt and completion tokens per minute (default: no limit)"
    )
    p_create.add_argument("--expires", default="", help="after 30d, 12h, 90m… (default: never)")
    add_key("list", "every key: state, models, limits, expiry (never a secret)")
    add_key("describe", "one key").add_argument("name")
    add_key("revoke", "refuse a key from now on, at every gateway").add_argument("name")
    p_usage = add("usage", "prompt and completion tokens and requests per key and deployment")
    p_usage.add_argument(
        "--by", choices=["key", "deployment"], default="", help="sum per key or per deployment only"
    )
    p_usage.add_argument("--since", default="24h", help="the last 24h, 30d, 90m… (default: %(default)s)")
    p_usage.add_argument("-o", "--output", choices=["json", "yaml"], default="", help="rows for scripts")
    return p_ctl
