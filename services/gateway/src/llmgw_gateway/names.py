"""The model name each replica's engine answers to (engines refuse any other), read from its
`/v1/models` once per replica and profile, however many requests ask at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anyio
import httpx

from llmgw_core.events import ReplicaRecord

log = logging.getLogger("llmgw.gateway")

# Replicas come and go on new ports: past this many names, the old ones are forgotten.
MAX_NAMES = 4096


@dataclass(slots=True)
class _Lookup:
    """A read of a replica's served model name under way (`ServedNames.of`)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    # Whether it ended with an answer (`name`; None: it could not be read), not cancelled.
    read: bool = False
    name: str | None = None


class ServedNames:
    """(replica URL, profile fingerprint) -> the model name its engine serves. The fingerprint:
    a changed profile restarted on the same port may serve another name."""

    __slots__ = ("_client", "_lookups", "_served")

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._served: dict[tuple[str, str], str] = {}
        # The reads of those names under way, which the other requests for the replica wait on.
        self._lookups: dict[tuple[str, str], _Lookup] = {}

    def known(self, record: ReplicaRecord) -> str | None:
        """The name read before, without a read: None where none was."""
        return self._served.get((record.url, record.profile_fp))

    def forget(self, record: ReplicaRecord) -> None:
        """The replica failed: its name is read again next time (it may come back as another)."""
        self._served.pop((record.url, record.profile_fp), None)

    async def of(self, record: ReplicaRecord) -> str | None:
        """The model name the replica's engine answers to, read once however many requests ask
        at once: the first reads it, the others wait for its answer (1,000 held requests
        released together each read it, and most timed out in the pool of the client that
        reads it, and were sent without the name)."""
        key = (record.url, record.profile_fp)
        while key not in self._served:
            lookup = self._lookups.get(key)
            if lookup is None:
                lookup = self._lookups[key] = _Lookup()
                try:
                    lookup.name = await self._read(record)
                    lookup.read = True
                finally:
                    del self._lookups[key]
                    lookup.done.set()
                return lookup.name
            await lookup.done.wait()
            if lookup.read:
                return lookup.name
            # The one reading it was cancelled (its client left): another reads it.
        return self._served[key]

    async def _read(self, record: ReplicaRecord) -> str | None:
        url = record.url
        key = (url, record.profile_fp)
        try:
            r = await self._client.get(f"{url}/v1/models", timeout=5.0)
            r.raise_for_status()
            name = str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("cannot read the model name %s serves (sending the request as it is): %s", url, exc)
            return None
        if len(self._served) >= MAX_NAMES:
            self._served.clear()
        self._served[key] = name
        return name
