"""Who a request's `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) is: the
keys of the keys bucket (kept from its watch) and of `http: api_keys_file`, looked up by the
hash of the secret.

Pure: the service feeds it every change of the bucket; the proxy asks it for a request's key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmgw_core.keys import ANONYMOUS, FILE_KEY_PREFIX, ApiKey, key_state, secret_hash

# Open access (keys not required): every model, no limit, usage counted under ANONYMOUS.
OPEN = ApiKey(name=ANONYMOUS, hash="0" * 64)


@dataclass(frozen=True)
class Refused:
    message: str
    code: str


def file_keys(secrets: frozenset[str]) -> dict[str, ApiKey]:
    """The keys of `api_keys_file`, by hash: every model, no limits, each named `file-` and the
    first 8 hex digits of its hash (stable however the file is reordered)."""
    out = {}
    for secret in secrets:
        digest = secret_hash(secret)
        out[digest] = ApiKey(name=f"{FILE_KEY_PREFIX}{digest[:8]}", hash=digest)
    return out


@dataclass
class Keyring:
    required: bool = True
    file: dict[str, ApiKey] = field(default_factory=dict)
    # The keys bucket: name -> key, and hash -> name.
    _by_name: dict[str, ApiKey] = field(default_factory=dict)
    _by_hash: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: ApiKey | None) -> None:
        old = self._by_name.pop(name, None)
        if old is not None and self._by_hash.get(old.hash) == name:
            del self._by_hash[old.hash]
        if value is not None:
            self._by_name[name] = value
            self._by_hash[value.hash] = name

    def identify(
        self, authorization: str, now: float | None = None, *, api_key: str = ""
    ) -> ApiKey | Refused:
        """The key `authorization` (the header's value) names, else `api_key` (the value of
        `x-api-key`, where Anthropic's clients send the key), or why the request is refused."""
        scheme, _, offered = authorization.partition(" ")
        offered = offered.strip()
        secret = offered if scheme.lower() == "bearer" else ""
        if not secret:
            secret = api_key.strip()
            offered = secret or offered
        key: ApiKey | None = None
        if secret:
            digest = secret_hash(secret)
            key = self.file.get(digest)
            if key is None:
                name = self._by_hash.get(digest)
                key = self._by_name.get(name) if name is not None else None
        if key is None:
            if not self.required:
                return OPEN
            what = "missing" if not offered else "unknown"
            return Refused(
                f"{what} API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a key "
                "that `llmgw ctl keys create` made (or one of the gateway's api_keys_file)",
                "invalid_api_key",
            )
        return self._state(key, now)

    def recheck(self, key: ApiKey, now: float | None = None) -> ApiKey | Refused:
        """`key` (found by `identify` for a request) as the keyring holds it now, or why the
        request is refused: a request held for a replica is sent only where its key is still
        active (one revoked while it waited was served 27 s after the revocation)."""
        if key is OPEN or not self.required:
            return key
        current = self.file.get(key.hash)
        if current is None:
            name = self._by_hash.get(key.hash)
            current = self._by_name.get(name) if name is not None else None
        if current is None:
            return Refused(
                f"API key {key.name!r} was deleted; send `Authorization: Bearer <key>` with a key that "
                "`llmgw ctl keys create` made",
                "invalid_api_key",
            )
        return self._state(current, now)

    def _state(self, key: ApiKey, now: float | None) -> ApiKey | Refused:
        state = key_state(key, time.time() if now is None else now)
        if state == "active":
            return key
        if not self.required:
            return OPEN
        if state == "revoked":
            return Refused(
                f"API key {key.name!r} was revoked at {_utc(key.revoked_at)}; ask for a new key",
                "revoked_api_key",
            )
        return Refused(
            f"API key {key.name!r} expired at {_utc(key.expires_at)}; ask for a new key", "expired_api_key"
        )


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
