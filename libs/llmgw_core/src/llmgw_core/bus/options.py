"""How to reach NATS and how much llmgw keeps there: the `nats:` section of agent.yaml and
server.yaml, with its environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from ..access import Identity, public_key_of
from ..store import BUCKETS
from ..subjects import DEFAULT_PREFIX

DEFAULT_URL = "nats://127.0.0.1:4222"


class BusOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach NATS; the `nats:` section of agent.yaml and server.yaml."""

    url: str = ""
    prefix: str = DEFAULT_PREFIX
    creds_file: str = ""
    # The identity's nkey seed (`llmgw auth init` writes one per identity); LLMGW_NATS_NKEY otherwise.
    nkey_seed_file: str = ""
    user: str = ""
    password: str = ""
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # 1 on one machine, 3 on a NATS cluster.
    replicas: int = 1
    connect_timeout_s: float = 15.0
    events_max_age_s: float = 7 * 24 * 3600
    events_max_bytes: int = 256 << 20
    # Connecting without any credentials must be asked for (LLMGW_NATS_INSECURE=1 does the same).
    insecure: bool = False
    # Replies and deliveries come here; an nkey identity's default is `_INBOX.<public key>`,
    # the private inbox its permissions name.
    inbox_prefix: str = ""
    # What one cluster holds, to size every bucket's byte limit (`llmgw_core.store`;
    # docs/operations.md has the formula and what the NATS store must hold for them).
    max_nodes: Annotated[int, Meta(ge=1)] = 256
    # Shard specs in the cluster: replicas times ranks, over every deployment.
    max_shards: Annotated[int, Meta(ge=1)] = 2048
    # Deployments, and as many profiles.
    max_deployments: Annotated[int, Meta(ge=1)] = 512
    # The largest value one key may hold; a larger write is refused (nats-server's max_payload
    # bounds it too, 1 MiB by default).
    max_value_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20
    # A bucket's byte limit by its name without the prefix (`shard-status: 268435456`),
    # instead of the formula's.
    bucket_max_bytes: dict[str, Annotated[int, Meta(ge=1)]] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.bucket_max_bytes) - set(BUCKETS))
        if unknown:
            raise ValueError(
                f"bucket_max_bytes names no bucket: {', '.join(unknown)} (the buckets: {', '.join(BUCKETS)})"
            )

    def resolved_url(self) -> str:
        return self.url or os.environ.get("LLMGW_NATS_URL", "") or DEFAULT_URL

    def resolved_nkey(self) -> str:
        return self.nkey_seed_file or os.environ.get("LLMGW_NATS_NKEY", "")

    def resolved_insecure(self) -> bool:
        return self.insecure or os.environ.get("LLMGW_NATS_INSECURE", "").lower() in ("1", "true", "yes")

    def authenticated(self) -> bool:
        """Whether this connection presents any credentials (a client certificate counts)."""
        url = urlsplit(self.resolved_url())
        return bool(
            self.creds_file
            or self.resolved_nkey()
            or self.user
            or self.token
            or self.tls_cert
            or url.username
        )

    def identity(self) -> Identity:
        nkey = self.resolved_nkey()
        if nkey:
            return Identity(Path(nkey).name.removesuffix(".nk"), public_key_of(nkey))
        if self.creds_file:
            return Identity(f"credentials {Path(self.creds_file).name}")
        user = self.user or urlsplit(self.resolved_url()).username
        if user:
            return Identity(f"user {user}")
        if self.token:
            return Identity("a token")
        if self.tls_cert:
            return Identity(f"client certificate {Path(self.tls_cert).name}")
        return Identity("no credentials")
