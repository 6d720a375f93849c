"""The data an engine adapter works on: profiles, shard specs, GPUs and commands.

All of it is plain msgspec data. The values that travel on the bus (a profile, a
ShardSpec as the value of a key in the shards bucket, a node's GPUs, a replica's
members) are defined with every other bus value in `llmgw_core.events`; the same
values feed the pure functions that build argv and environments.
"""

from __future__ import annotations

from typing import Protocol

from msgspec import Struct

from ..events import GPUInfo, Profile, ShardSpec


class Address(Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Command(Struct, frozen=True, kw_only=True):
    """One process of a shard, fully resolved: nothing is left to a shell."""

    name: str
    path: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Held until every address accepts a TCP connection: a Ray worker waits
    # for its head, a llama.cpp leader waits for its workers' RPC servers.
    wait_for: tuple[Address, ...] = ()

    @property
    def argv(self) -> list[str]:
        return [self.path, *self.args]

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


# The OpenAI-style paths every engine serves; each adapter's `api_paths` names what its
# server answers beyond them, and the gateway refuses the rest with a 400 naming the engine.
BASE_API_PATHS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})


class Engine(Protocol):
    """What an engine adapter provides. Adapters build data; they never start a process."""

    @property
    def name(self) -> str: ...

    @property
    def health_path(self) -> str: ...

    @property
    def metrics_path(self) -> str: ...

    @property
    def api_paths(self) -> frozenset[str]:
        """The HTTP API paths the engine's server answers: `BASE_API_PATHS` and its own."""
        ...

    def validate(
        self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None
    ) -> list[str]: ...

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]: ...

    def serves_http(self, shard: ShardSpec) -> bool: ...
