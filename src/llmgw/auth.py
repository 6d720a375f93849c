"""`llmgw auth`: the cluster's identities, their nats-server permissions and the API tokens.

`llmgw auth init --dir DIR --node gpu-01 --node gpu-02` writes into DIR:

    placement.nk ctl.nk observer.nk gateway.nk node-<id>.nk   one nkey seed per identity (0600)
    auth.conf        the `authorization` block to `include` from nats-server.conf
    api-token        placement's HTTP API: reads and writes (bearer token)
    api-read-token   placement's HTTP API: reads only (dashboards)
    auth.json        the subject prefix the permissions were written for

`add-node`, `remove-node` and `rotate` change the identities and rewrite
auth.conf; nats-server picks it up on `nats-server --signal reload` (SIGHUP).
Running `init` again keeps every existing key.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from llmgw_core.access import NODE_ROLE_PREFIX, ROLES, permissions, public_key_of
from llmgw_core.errors import ConfigError
from llmgw_core.limits import NAME_MAX, name_problem
from llmgw_core.subjects import DEFAULT_PREFIX, Names

BASE_ROLES = ("placement", "ctl", "observer", "gateway")
SEED_SUFFIX = ".nk"
CONF = "auth.conf"
MANIFEST = "auth.json"
API_TOKEN = "api-token"
API_READ_TOKEN = "api-read-token"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _check_node(node: str) -> str:
    problem = name_problem("node id", node)
    if problem is not None and len(node) > NAME_MAX:
        raise ConfigError(problem)
    if not _TOKEN.match(node):
        raise ConfigError(
            f"{node!r} is not a node id: node ids match [A-Za-z0-9_-]+ (a dot splits a subject); "
            "for gpu-01.dc1.example.com use gpu-01"
        )
    return node


def _write_secret(path: Path, text: str) -> None:
    """Write a file only its owner can read, replacing any old one atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def new_seed() -> str:
    """A fresh user nkey seed (`SU…`)."""
    import nkeys  # type: ignore[import-untyped]

    pair = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    try:
        return str(pair.seed.decode())
    finally:
        pair.wipe()


def render_users(prefix: str, identities: dict[str, str]) -> list[str]:
    """One `users` entry per identity (name -> public key), with its permissions."""
    names = Names(prefix)
    entries = []
    for name, public_key in sorted(identities.items()):
        perms = permissions(name, names, public_key)
        publish = ",\n".join(f"          {json.dumps(s)}" for s in perms.publish)
        subscribe = ",\n".join(f"          {json.dumps(s)}" for s in perms.subscribe)
        entries.append(
            f"    # {name}\n"
            "    {\n"
            f"      nkey: {public_key}\n"
            "      permissions: {\n"
            f"        publish: {{ allow: [\n{publish}\n        ] }}\n"
            f"        subscribe: {{ allow: [\n{subscribe}\n        ] }}\n"
            + ("        allow_responses: true\n" if perms.allow_responses else "")
            + "      }\n"
            "    }"
        )
    return entries


def render_conf(prefix: str, identities: dict[str, str], extra_users: tuple[str, ...] = ()) -> str:
    users = "\n".join([*render_users(prefix, identities), *extra_users])
    return (
        f"# llmgw's identities for the subject prefix {prefix!r}, written by `llmgw auth`.\n"
        '# Include it from nats-server.conf (a path relative to that file):  include "auth.conf"\n'
        "# After `llmgw auth add-node`, `remove-node` or `rotate`: nats-server --signal reload\n"
        "authorization {\n"
        "  users = [\n"
        f"{users}\n"
        "  ]\n"
        "}\n"
    )


@dataclass
class AuthDir:
    """A directory of identities, as `llmgw auth` writes it."""

    path: Path

    @property
    def conf(self) -> Path:
        return self.path / CONF

    @property
    def api_token_file(self) -> Path:
        return self.path / API_TOKEN

    @property
    def api_read_token_file(self) -> Path:
        return self.path / API_READ_TOKEN

    def seed(self, name: str) -> Path:
        return self.path / f"{name}{SEED_SUFFIX}"

    def node_seed(self, node: str) -> Path:
        return self.seed(f"{NODE_ROLE_PREFIX}{node}")

    @property
    def prefix(self) -> str:
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(
                f"{self.path} holds no llmgw identities ({MANIFEST} is missing); "
                f"run `llmgw auth init --dir {self.path} --node <node id>` first"
            ) from exc
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path / MANIFEST}: cannot read it: {exc}") from exc
        return str(manifest["prefix"])

    def exists(self) -> bool:
        return (self.path / MANIFEST).exists()

    def identities(self) -> dict[str, str]:
        """Every identity in the directory: name -> public key."""
        found = {}
        for seed in sorted(self.path.glob(f"*{SEED_SUFFIX}")):
            name = seed.name.removesuffix(SEED_SUFFIX)
            if name in ROLES or name.startswith(NODE_ROLE_PREFIX):
                found[name] = public_key_of(str(seed))
        return found

    def token(self, read_only: bool = False) -> str:
        path = self.api_read_token_file if read_only else self.api_token_file
        return path.read_text().strip()

    # --- changes -------------------------------------------------------------

    def init(self, nodes: list[str], *, prefix: str = DEFAULT_PREFIX, fleet: bool = False) -> list[str]:
        """Create what is missing (keys that exist are kept); returns the identities created."""
        for node in nodes:
            _check_node(node)
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        if self.exists() and self.prefix != prefix:
            raise ConfigError(
                f"{self.path} holds identities for the prefix {self.prefix!r}, not {prefix!r}; "
                "use another directory for another cluster"
            )
        _write_secret(self.path / MANIFEST, json.dumps({"prefix": prefix}) + "\n")
        wanted = [*BASE_ROLES, *(["fleet"] if fleet else []), *(f"{NODE_ROLE_PREFIX}{n}" for n in nodes)]
        created = [name for name in wanted if self._create(name)]
        for token_file in (self.api_token_file, self.api_read_token_file):
            if not token_file.exists():
                _write_secret(token_file, secrets.token_urlsafe(32) + "\n")
        self.write_conf()
        return created

    def _create(self, name: str) -> bool:
        if self.seed(name).exists():
            return False
        _write_secret(self.seed(name), new_seed() + "\n")
        return True

    def add_node(self, node: str) -> bool:
        """Give a node its identity; False if it had one already."""
        self.prefix  # noqa: B018 (refuses a directory that `init` never wrote)
        created = self._create(f"{NODE_ROLE_PREFIX}{_check_node(node)}")
        self.write_conf()
        return created

    def remove_node(self, node: str) -> None:
        seed = self.node_seed(_check_node(node))
        if not seed.exists():
            raise ConfigError(f"{self.path} has no identity for node {node}")
        seed.unlink()
        self.write_conf()

    def rotate(self, name: str) -> None:
        """A new key for an identity: the old one stops working at the server's next reload."""
        if not self.seed(name).exists():
            known = ", ".join(sorted(self.identities())) or "none"
            raise ConfigError(f"{self.path} has no identity {name!r} (it has: {known})")
        _write_secret(self.seed(name), new_seed() + "\n")
        self.write_conf()

    def rotate_tokens(self) -> None:
        for token_file in (self.api_token_file, self.api_read_token_file):
            _write_secret(token_file, secrets.token_urlsafe(32) + "\n")

    def write_conf(self) -> None:
        _write_secret(self.conf, render_conf(self.prefix, self.identities()))


def main(args: argparse.Namespace) -> int:
    """`llmgw auth …` as parsed by `llmgw.cli`."""
    action = args.auth
    auth = AuthDir(Path(args.dir))
    if action == "init":
        created = auth.init(list(args.node), prefix=args.prefix, fleet=args.fleet)
        print(f"llmgw auth: {len(created)} new identities in {auth.path}: {', '.join(created) or 'none'}")
        print(f"llmgw auth: include {auth.conf} from nats-server.conf (a relative path), then reload it")
        print(
            f"llmgw auth: the API's bearer tokens are in {auth.api_token_file} and {auth.api_read_token_file}"
        )
    elif action == "add-node":
        node = args.node
        added = auth.add_node(node)
        state = "new identity" if added else "identity kept"
        print(f"llmgw auth: node {node}: {state} {auth.node_seed(node)}; auth.conf rewritten")
        print(
            "llmgw auth: copy the seed to the node (agent.yaml nats: nkey_seed_file) and reload nats-server"
        )
    elif action == "remove-node":
        node = args.node
        auth.remove_node(node)
        print(f"llmgw auth: node {node} removed; reload nats-server to shut it out")
    elif action == "rotate":
        name = args.identity
        if name == "api-tokens":
            auth.rotate_tokens()
            print("llmgw auth: new API tokens written; restart placement to use them")
        else:
            auth.rotate(name)
            print(
                f"llmgw auth: new key in {auth.seed(name)}; reload nats-server, then restart the processes "
                "that use this identity with the new seed"
            )
    return 0
