"""The test session's nats-server wants credentials, as a deployed one does.

Tests observe and arrange through a `harness` user with every right (its
password is in the `nats_url` they get); the processes under test connect
with their own llmgw identities, made per test prefix by `llmgw auth` and
added to the running server with a reload.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.auth import AuthDir, render_users
from llmgw_core.natsd import NatsServer

HARNESS_USER = "harness"


@dataclass
class SessionNats:
    server: NatsServer
    users_conf: Path
    password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    dirs: dict[str, AuthDir] = field(default_factory=dict)

    @classmethod
    def start(cls, store_dir: Path, max_store: str = "") -> SessionNats:
        store_dir.mkdir(parents=True, exist_ok=True)
        users = store_dir / "users.conf"
        server = NatsServer(store_dir=store_dir, includes=(users,), max_store=max_store)
        nats = cls(server, users)
        nats.write()
        server.start()
        return nats

    @property
    def url(self) -> str:
        """The address, with no credentials in it (processes add their identity)."""
        return self.server.url

    @property
    def harness_url(self) -> str:
        return f"nats://{HARNESS_USER}:{self.password}@{self.server.host}:{self.server.port}"

    def write(self) -> None:
        entries = [f"    {{user: {HARNESS_USER}, password: {self.password!r}}}".replace("'", '"')]
        for prefix, auth in sorted(self.dirs.items()):
            entries += render_users(prefix, auth.identities())
        body = "\n".join(entries)
        self.users_conf.write_text(f"authorization {{\n  users = [\n{body}\n  ]\n}}\n")

    def identities(self, prefix: str, root: Path, nodes: list[str] | None = None) -> AuthDir:
        """`llmgw auth init` for a test's prefix, live on the server once this returns."""
        auth = self.dirs.get(prefix) or AuthDir(root)
        auth.init(nodes or [], prefix=prefix, fleet=True)
        self.dirs[prefix] = auth
        self.write()
        self.server.reload()
        return auth

    def add_node(self, prefix: str, node: str) -> AuthDir:
        auth = self.dirs[prefix]
        if auth.add_node(node):
            self.write()
            self.server.reload()
        return auth

    def stop(self) -> None:
        self.server.stop()


# The session's server, for helpers that start processes (tests.cluster_support).
SESSION: SessionNats | None = None


def session_for(url: str) -> SessionNats | None:
    """The session's server if `url` is its harness address (an external server has no identities)."""
    if SESSION is None:
        return None
    parts, ours = urlsplit(url), urlsplit(SESSION.harness_url)
    return SESSION if (parts.hostname, parts.port) == (ours.hostname, ours.port) else None
