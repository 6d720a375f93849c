"""`gateway.yaml`: where the gateway listens, how it reaches NATS, and whether clients need a key."""

from __future__ import annotations

from pathlib import Path

from msgspec import Struct

from llmgw_core.config import NatsConfig
from llmgw_core.errors import ConfigError


class HttpConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    # 0: any free port (printed at start).
    port: int = 8000
    # Clients must send `Authorization: Bearer <key>`, one of the keys in `api_keys_file`
    # (one a line, `#` comments). Off by default: a local cluster's endpoint is open.
    require_api_key: bool = False
    api_keys_file: str = ""


class GatewayConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nats: NatsConfig = NatsConfig()
    http: HttpConfig = HttpConfig()
    # The most a client may send in one request body.
    max_body_bytes: int = 8 << 20
    # How long to wait for a replica to accept a connection before trying another.
    connect_timeout_s: float = 5.0
    # How long to wait for the first byte of an answer, then between bytes (0: no limit;
    # a long generation streams slowly, and a queued request waits its turn).
    read_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        # ValueError: msgspec reports it with the file's name, as any other mistake in it.
        if self.http.require_api_key and not self.http.api_keys_file:
            raise ValueError(
                "http: require_api_key is true but http: api_keys_file is empty; "
                "name a file with one client key a line"
            )
        if self.http.api_keys_file and not self.http.require_api_key:
            raise ValueError(
                "http: api_keys_file is set but http: require_api_key is false; "
                "set require_api_key: true to check client keys, or drop api_keys_file"
            )


def load_api_keys(path: str) -> frozenset[str]:
    """The client keys in `path`, or ConfigError saying what is wrong with the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read http: api_keys_file {path}: {exc.strerror or exc}") from exc
    keys = frozenset(
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise ConfigError(f"http: api_keys_file {path} holds no key; write one client key a line")
    return keys
