"""The rules of a valid name and size, in one place.

Every entry (placement's API, `llmgw ctl`, server.yaml, agent.yaml) refuses
what breaks them with the words of `name_problem` and its kin; every reader of
the bus dead-letters a stored value that breaks them (the message types carry
them as msgspec constraints) and a stored key that breaks them (`key_problem`).

Why names are bounded: each one becomes part of NATS subjects and KV keys
(`<prefix>.events.shard.<node>.<deployment>-<replica>-<rank>`). nats-server
refuses a protocol line over 4 KB (`maximum control line exceeded`) and the
client library then closes the connection for good: one 3,955-character
deployment name, stored once, turned every placement and launcher that
published about it into a process with no bus.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated, Protocol

from msgspec import Meta

# Letters, digits, '-' and '_': a dot splits a NATS subject, so `gpu-01.dc1` would
# silently become two tokens and match the wrong filters; `*` and `>` are wildcards.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]+$"
# A name an operator chooses (deployment, profile, node): as long as a DNS label.
NAME_MAX = 63
# An id llmgw makes from names (a shard is `<deployment>-<replica>-<rank>`).
TOKEN_MAX = 128
# A model name clients may send for a deployment (`meta-llama/Llama-3.1-8B-Instruct`), and how
# many one deployment may have.
ALIAS_MAX = 255
ALIASES_MAX = 32
# The largest `max_replicas` a server.yaml may set.
REPLICAS_CEILING = 1_000_000
# The longest interval between a gateway's demand reports (its `demand_interval_s`): placement
# reads a report's `interval_s` as at most this, so no report outlives a few minutes.
DEMAND_INTERVAL_MAX_S = 60.0

Name = Annotated[str, Meta(pattern=TOKEN_PATTERN, max_length=NAME_MAX)]
Token = Annotated[str, Meta(pattern=TOKEN_PATTERN, max_length=TOKEN_MAX)]
Alias = Annotated[str, Meta(min_length=1, max_length=ALIAS_MAX)]
Aliases = Annotated[tuple[Alias, ...], Meta(max_length=ALIASES_MAX)]

_TOKEN = re.compile(TOKEN_PATTERN)
# How much of an over-long value a message shows.
_SHOWN = 24
# The most each kind of key part may hold.
_PART_MAX = {"deployment": NAME_MAX, "profile": NAME_MAX, "node": NAME_MAX}


def shown(value: str) -> str:
    """`value` quoted for a message, cut short when long (a message never echoes 4 KB back)."""
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "…")


def name_problem(what: str, value: str, *, limit: int = NAME_MAX) -> str | None:
    """Why `value` cannot be the name of a `what` (deployment, profile, node); None when it can."""
    if len(value) > limit:
        return (
            f"{what} {shown(value)} is {len(value)} characters long, over the limit of {limit}: "
            f"use a name of at most {limit} letters, digits, '-' and '_', e.g. chat-7b"
        )
    if not _TOKEN.match(value):
        return (
            f"{what} {shown(value)} is not a valid name: use letters, digits, '-' and '_' "
            "(a dot splits a subject), e.g. chat-7b"
        )
    return None


def key_problem(key: str, *parts: str) -> str | None:
    """Why `key` is not a KV key made of the names `parts` joined by dots (a shard status is
    `key_problem(key, "node", "shard")`); None when it is. A key that breaks this is never
    used as part of a subject."""
    if len(parts) == 1:
        return name_problem(f"{parts[0]} key", key, limit=_PART_MAX.get(parts[0], TOKEN_MAX))
    found = key.split(".", len(parts) - 1)
    if len(found) != len(parts):
        return f"key {shown(key)} is not {'.'.join(p.upper() for p in parts)}"
    for part, value in zip(parts, found, strict=True):
        problem = name_problem(part, value, limit=_PART_MAX.get(part, TOKEN_MAX))
        if problem is not None:
            return f"key {shown(key)}: {problem}"
    return None


def aliases_problem(deployment: str, aliases: tuple[str, ...]) -> str | None:
    """Why a deployment cannot have these aliases; None when it can."""
    if len(aliases) > ALIASES_MAX:
        return (
            f"deployment {shown(deployment)} has {len(aliases)} aliases, over the limit of {ALIASES_MAX}: "
            "keep the names clients really send"
        )
    for alias in aliases:
        if not alias or len(alias) > ALIAS_MAX:
            return (
                f"deployment {shown(deployment)}: alias {shown(alias)} is {len(alias)} characters long; "
                f"an alias is 1 to {ALIAS_MAX} characters"
            )
    return None


def replicas_problem(deployment: str, replicas: int, max_replicas: int) -> str | None:
    """Why a deployment cannot ask for `replicas`; None when it can."""
    if replicas < 0:
        return f"deployment {deployment} asks for {_count(replicas)} replicas: a replica count is 0 or more"
    if replicas > max_replicas:
        return (
            f"deployment {deployment} asks for {_count(replicas)} replicas, over the maximum of "
            f"{max_replicas} (placement's max_replicas in server.yaml)"
        )
    return None


def _count(n: int) -> str:
    """A count for a message: in full, or its order of magnitude when absurd (10**30)."""
    digits = len(str(abs(n)))
    return str(n) if digits <= 12 else f"{'-' if n < 0 else ''}10^{digits - 1} or more"


# --- references -------------------------------------------------------------------------------
#
# A deployment names a profile and a profile names an engine. Every entry refuses a reference
# to nothing before it stores anything, with these words: placement would take a deployment
# whose profile is not in the catalog as "not placeable", and stop its replicas (one typo in
# an applied file stopped a healthy deployment and the gateway answered 503).


def profile_problem(deployment: str, profile: str, catalog: Collection[str]) -> str | None:
    """Why a deployment cannot name `profile`, given the catalog's profile names; None when it can."""
    if profile in catalog:
        return None
    known = ", ".join(sorted(catalog)) or "none (write one with `llmgw ctl apply -f server.yaml`)"
    return f"unknown profile {profile!r} for deployment {deployment}: the catalog has {known}"


def engine_problem(owner: str, engine: str, engines: Collection[str]) -> str | None:
    """Why `owner` (`profile tiny`, `the desired engines`) cannot name `engine`, given the
    engines llmgw runs; None when it can."""
    if engine in engines:
        return None
    return f"unknown engine {engine!r} for {owner}: llmgw runs {', '.join(sorted(engines))}"


# --- documents ---------------------------------------------------------------------------------
#
# A YAML or JSON document read from outside (`llmgw ctl apply -f FILE`) is measured before it
# is decoded, by libyaml's event stream, which holds no recursion: a file of 100,000 `[` crashed
# the decoder's process outright (a segmentation fault, no error to catch), 5,000 `{` raised
# RecursionError past every handler, and anchors let a few kilobytes stand for millions of
# nodes (each alias is validated again wherever it is used).

DOCUMENT_MAX_BYTES = 8 << 20
DOCUMENT_MAX_DEPTH = 64
DOCUMENT_MAX_NODES = 1_000_000


def document_problem(
    raw: bytes,
    *,
    max_bytes: int = DOCUMENT_MAX_BYTES,
    max_depth: int = DOCUMENT_MAX_DEPTH,
    max_nodes: int = DOCUMENT_MAX_NODES,
) -> str | None:
    """Why `raw` is too big to decode: over `max_bytes`, collections nested over `max_depth`
    deep, or over `max_nodes` values once every alias is expanded; None when it is not (or
    when it is not YAML at all: the decoder says where). Measured without recursion."""
    import yaml

    if len(raw) > max_bytes:
        return f"{len(raw)} bytes, over the limit of {max_bytes}: split it into smaller files"
    # Open collections' expanded sizes, and each anchor's, as aliases expand them.
    open_sizes: list[int] = [0]
    anchors: dict[str, int] = {}
    opened: list[str | None] = []
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        for event in yaml.parse(raw, Loader=loader):
            size = 0
            if isinstance(event, yaml.CollectionStartEvent):
                opened.append(event.anchor)
                open_sizes.append(1)
                if len(opened) > max_depth:
                    return f"collections nested over {max_depth} deep: flatten it"
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                size = open_sizes.pop()
                anchor = opened.pop()
                if anchor is not None:
                    anchors[anchor] = size
            elif isinstance(event, yaml.ScalarEvent):
                size = 1
                if event.anchor is not None:
                    anchors[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                size = anchors.get(event.anchor or "", 1)
            else:
                continue
            open_sizes[-1] += size
            if sum(open_sizes) > max_nodes:
                return f"over {max_nodes} values once its aliases are expanded: write it out plainly"
    except yaml.YAMLError:
        return None
    return None


class Routed(Protocol):
    """A deployment as its names go: a stored `Deployment`, or one in a server.yaml."""

    @property
    def name(self) -> str: ...

    @property
    def aliases(self) -> tuple[str, ...]: ...
