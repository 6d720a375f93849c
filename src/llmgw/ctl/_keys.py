"""`llmgw ctl keys …` (client API keys in the keys bucket) and `llmgw ctl usage` (the usage stream)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec

from llmgw_core.bus import Bus
from llmgw_core.keys import (
    FILE_KEY_PREFIX,
    ApiKey,
    UsageRecord,
    UsageRow,
    key_state,
    new_secret,
    parse_duration,
    secret_hash,
)
from llmgw_core.limits import ALIAS_MAX, name_problem

from . import _views as views
from ._errors import NotFound, Refused, UsageError

# How long `usage` waits for one more record before taking what it read as all there is.
USAGE_IDLE_S = 1.0


class KeyView(msgspec.Struct, frozen=True, kw_only=True):
    """A key as `keys list` and `keys describe` show it: never the secret, nor its whole hash."""

    name: str
    state: str
    models: list[str]
    rpm: int
    tpm: int
    created_at: float
    expires_at: float
    revoked_at: float
    # The first 8 hex digits of the secret's SHA-256: tells two keys apart in a gateway's log.
    fingerprint: str


def _view(key: ApiKey, now: float) -> KeyView:
    return KeyView(
        name=key.name,
        state=key_state(key, now),
        models=list(key.models),
        rpm=key.rpm,
        tpm=key.tpm,
        created_at=key.created_at,
        expires_at=key.expires_at,
        revoked_at=key.revoked_at,
        fingerprint=key.hash[:8],
    )


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at)) if at else "never"


def _check_key_name(name: str) -> None:
    problem = name_problem("key", name)
    if problem is not None:
        raise UsageError(problem)
    if name.startswith(FILE_KEY_PREFIX):
        raise UsageError(
            f"key name {name!r} starts with {FILE_KEY_PREFIX!r}, which names the keys of a gateway's "
            "api_keys_file: choose another name"
        )


def parse_models(text: str) -> tuple[str, ...]:
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    for m in models:
        if len(m) > ALIAS_MAX:
            raise UsageError(
                f"--models: {m[:24]!r}… is over {ALIAS_MAX} characters; name a deployment or alias"
            )
    return tuple(dict.fromkeys(models))


async def create(bus: Bus, name: str, *, models: str, rpm: int, tpm: int, expires: str, output: str) -> str:
    _check_key_name(name)
    for flag, value in (("--rpm", rpm), ("--tpm", tpm)):
        if value < 0:
            raise UsageError(f"{flag} {value}: a limit per minute is 0 (none) or more")
    now = time.time()
    expires_at = 0.0
    if expires:
        seconds = parse_duration(expires)
        if seconds is None:
            raise UsageError(f"--expires {expires!r}: give a duration such as 30d, 12h, 90m, 45s or 2w")
        expires_at = now + seconds
    secret = new_secret()
    key = ApiKey(
        name=name,
        hash=secret_hash(secret),
        models=parse_models(models),
        rpm=rpm,
        tpm=tpm,
        created_at=now,
        expires_at=expires_at,
    )
    if await bus.create(bus.names.keys_bucket, name, key) is None:
        raise Refused(
            f"key {name} exists already (`llmgw ctl keys describe {name}`); revoke it "
            f"(`llmgw ctl keys revoke {name}`) and create one under another name"
        )
    if output in ("json", "yaml"):
        return views.render_data({"secret": secret, **msgspec.to_builtins(_view(key, now))}, output)
    scope = ", ".join(key.models) if key.models else "every model"
    limits = ", ".join(f"{v} {w}/min" for v, w in ((rpm, "requests"), (tpm, "tokens")) if v) or "no limits"
    return (
        f"key {name} created ({scope}; {limits}; expires {_utc(expires_at)}).\n"
        "Its secret, shown only now (llmgw keeps only its hash):\n"
        f"{secret}"
    )


async def stored(bus: Bus, name: str) -> tuple[ApiKey, int]:
    _check_key_name(name)
    found = await bus.get(bus.names.keys_bucket, name, ApiKey)
    if found is None:
        raise NotFound(f"no key {name} (`llmgw ctl keys list` lists them)")
    return found


async def listing(bus: Bus, output: str) -> str:
    now = time.time()
    entries = await bus.entries(bus.names.keys_bucket, ApiKey)
    keys = [_view(c.value, now) for _, c in sorted(entries.items()) if c.value is not None]
    if output in ("json", "yaml"):
        return views.render_data(keys, output)
    if output == "name":
        return "\n".join(f"key/{k.name}" for k in keys)
    rows = [
        [
            k.name,
            k.state,
            ",".join(k.models) or "*",
            str(k.rpm or "-"),
            str(k.tpm or "-"),
            _utc(k.expires_at),
            _utc(k.created_at),
        ]
        for k in keys
    ]
    return views.table(["NAME", "STATE", "MODELS", "RPM", "TPM", "EXPIRES", "CREATED"], rows)


async def describe(bus: Bus, name: str, output: str) -> str:
    key, _ = await stored(bus, name)
    view = _view(key, time.time())
    if output in ("json", "yaml"):
        return views.render_data(view, output)
    lines = [
        f"Key:          {view.name}",
        f"State:        {view.state}",
        f"Models:       {', '.join(view.models) or 'every model'}",
        f"Requests/min: {view.rpm or 'no limit'}",
        f"Tokens/min:   {view.tpm or 'no limit'}",
        f"Created:      {_utc(view.created_at)}",
        f"Expires:      {_utc(view.expires_at)}",
        f"Fingerprint:  {view.fingerprint} (the secret's SHA-256, first digits)",
    ]
    if view.revoked_at:
        lines.insert(2, f"Revoked:      {_utc(view.revoked_at)}")
    return "\n".join(lines)


async def revoke(bus: Bus, name: str) -> str:
    for _ in range(10):
        key, revision = await stored(bus, name)
        if key.revoked_at:
            return f"key {name} was revoked already, at {_utc(key.revoked_at)}"
        revoked = msgspec.structs.replace(key, revoked_at=time.time())
        if await bus.update(bus.names.keys_bucket, name, revoked, last=revision) is not None:
            return f"key {name} revoked: every gateway refuses it (401) as soon as it hears"
    raise Refused(f"key {name} changed 10 times while being revoked; try again")


# --- usage -------------------------------------------------------------------------------


async def records(bus: Bus, since_s: float) -> list[UsageRecord]:
    """Every usage record written in the last `since_s` seconds, oldest first."""
    stream = bus.names.usage_stream
    info = await bus.stream_info(stream)
    if not info.state.messages:
        return []  # nothing to wait out
    found: list[UsageRecord] = []
    replayed = bus.replay(
        bus.names.usage_all, UsageRecord, stream=stream, since=time.time() - since_s, idle_s=USAGE_IDLE_S
    )
    async with contextlib.aclosing(replayed):
        async for record in replayed:
            if record is not None:
                found.append(record.value)
    return found


def summed(found: list[UsageRecord], by: str) -> list[UsageRow]:
    """Rows per key and deployment (`by` ""), per key (deployment `*`) or per deployment (key `*`)."""
    sums: dict[tuple[str, str], list[int]] = {}
    for r in found:
        group = (r.key if by != "deployment" else "*", r.deployment if by != "key" else "*")
        counts = sums.setdefault(group, [0, 0, 0])
        counts[0] += r.prompt_tokens
        counts[1] += r.completion_tokens
        counts[2] += r.requests
    return [
        UsageRow(key=k, deployment=d, prompt_tokens=p, completion_tokens=c, requests=n)
        for (k, d), (p, c, n) in sorted(sums.items())
    ]


async def usage(bus: Bus, *, by: str, since: str, output: str) -> str:
    seconds = parse_duration(since)
    if seconds is None:
        raise UsageError(f"--since {since!r}: give a duration such as 24h, 30d, 90m or 2w")
    rows = summed(await records(bus, seconds), by)
    if output in ("json", "yaml"):
        return views.render_data(rows, output)
    table: list[list[Any]] = [
        [r.key, r.deployment, str(r.requests), str(r.prompt_tokens), str(r.completion_tokens)] for r in rows
    ]
    return views.table(["KEY", "DEPLOYMENT", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS"], table)
