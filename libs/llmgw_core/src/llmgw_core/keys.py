"""Client API keys, their per-minute windows and the usage they record: the messages and the
pure rules over them.

A key is stored by its name in the keys bucket with the SHA-256 of its secret, never the
secret: `llmgw ctl keys create` shows the secret once. SHA-256 without a salt is enough
here: a secret is 32 random bytes, so no table or guessing finds one from its hash, and
the gateway checks a request's key with one hash and one dict lookup.

Limits are per minute (`window`: Unix time // 60, the same on every gateway up to their
clocks' skew), counted in the limits bucket per key (`KeyWindow`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from typing import Annotated

from msgspec import Meta, Struct, field

from .events import Message
from .limits import Alias, Name

# What a secret starts with: recognisable in a config file or a leaked log line.
SECRET_PREFIX = "sk-llmgw-"
WINDOW_S = 60
# A key name the gateway gives keys of its own, never one `ctl keys create` takes.
FILE_KEY_PREFIX = "file-"
ANONYMOUS = "_"

Count = Annotated[int, Meta(ge=0)]


class ApiKey(Message, frozen=True):
    name: Name
    # SHA-256 of the secret, hex.
    hash: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
    # Model names the key may send (`allows`: the deployments they route to); empty: every model.
    models: tuple[Alias, ...] = ()
    # Requests and tokens (prompt + completion) per minute; 0: no limit.
    rpm: Count = 0
    tpm: Count = 0
    created_at: float = 0.0
    # Unix seconds; 0: never.
    expires_at: float = 0.0
    revoked_at: float = 0.0


class Spent(Struct, frozen=True, array_like=True):
    """One gateway process's part of a key's minute."""

    requests: Count = 0
    tokens: Count = 0


class KeyWindow(Message, frozen=True):
    """One key's current minute, as every gateway claims it: `requests` handed out to
    gateways (each serves up to what it claimed), `tokens` spent by answers that ended.

    `by` holds each gateway process's part of both, which only that process writes, and
    always as its running total for the minute, never as an increment: a write whose answer
    was lost (it landed, its writer timed out) and is made again counts nothing twice. The
    totals are the sum of the parts, and of what writers without a part (older gateways) added.
    """

    window: int
    requests: Count = 0
    tokens: Count = 0
    by: dict[Annotated[str, Meta(max_length=128)], Spent] = field(default_factory=dict)


class UsageRecord(Message, frozen=True):
    """What one gateway served for one key and deployment in one interval."""

    key: str
    deployment: str
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    requests: Count = 0
    # Unix seconds: the interval the counts cover.
    start: float = 0.0
    end: float = 0.0
    gateway: str = ""


class UsageRow(Struct, frozen=True, kw_only=True):
    """Tokens spent, summed per key and deployment (`*` where the rows are summed over it):
    one row as `llmgw ctl usage` prints it and writes it with `-o json`, and as the cluster
    page's `/api/usage` answers it."""

    key: str
    deployment: str
    prompt_tokens: int
    completion_tokens: int
    requests: int


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def window_of(at: float) -> int:
    return int(at // WINDOW_S)


def retry_after(at: float) -> int:
    """Whole seconds until the window holding `at` ends (at least 1)."""
    return max(1, int(WINDOW_S - at % WINDOW_S + 0.999))


_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float | None:
    """`30d`, `12h`, `90m`, `45s`, `2w` in seconds; None when it is none of those."""
    m = _DURATION.match(text.strip())
    if m is None or int(m.group(1)) == 0:
        return None
    return float(int(m.group(1)) * _UNITS[m.group(2)])


def key_state(key: ApiKey, now: float) -> str:
    """`active`, `expired` or `revoked`."""
    if key.revoked_at:
        return "revoked"
    if key.expires_at and now >= key.expires_at:
        return "expired"
    return "active"


def allows(key: ApiKey, deployment: str, routes_to: Callable[[str], str | None]) -> bool:
    """Whether `key` may call the deployment named `deployment`: whether one of the names the
    key was given routes there. `routes_to` is the gateway's own resolution of a model name
    (a deployment's name first, then the aliases).

    A key's models are names as a client sends them, never matched against the aliases of
    the deployment asked for: matched that way, a key made with `--models chat` called any
    deployment that listed `chat` among its aliases (`zzz`, aliased `chat`, was served to a
    key meant for the deployment `chat` alone). Resolved, `chat` means the deployment `chat`,
    or, where none has that name, the one deployment whose alias it is; the key then calls
    that deployment by any of its names."""
    if not key.models:
        return True
    return any(routes_to(model) == deployment for model in key.models)
