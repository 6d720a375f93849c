"""An engine lock's wheels gathered into a directory of their own, from peers first, the origin once.

    <engines>/.wheels/<lock digest>/          the lock's wheels, one per package, and
                                              `manifest.json` (written last: a directory
                                              without it is not complete and never offered)
    <engines>/.wheels/<lock digest>.partial/  while gathering; removed on any failure

A node that holds a lock's wheels says so in its status (`wheels`, `held`, with its wheel
server's URL on its own `mgmt_addr`). A node gathering them first claims the lock in its status
(`fetching`, since when); then (`plan`, pure) it reads from nodes that hold them, or waits for a
node that claimed first (earlier `since`, then the smaller id) to finish, or, if neither, fetches
from the origin: the index the lock's source names. So nodes installing one lock at once ask the
origin once. A claim's order is each node's own clock: skew between nodes can cost a second
origin fetch, never a wrong wheel.

Every wheel, whoever sends it, is read to at most its declared size (a peer's manifest, else the
lock's total), hashed as it arrives, and kept only if its sha256 is one the lock names for it;
a peer that sends anything else is not asked again in this gather and the wheel is fetched
elsewhere; what it sent is discarded, and said.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import anyio
import httpx
from packaging.tags import Tag, sys_tags
from packaging.utils import canonicalize_name

from llmgw_core.events import NodeStatus

from .errors import DownloadError, InstallError
from .lock import Lock, Package
from .wheelfetch import WheelDiskError, fetch_from_peer, fetch_wheel, read_bounded
from .wheelfiles import (
    MAX_MANIFEST_BYTES,
    MAX_PAGE_BYTES,
    MAX_WHEEL_BYTES,
    Offered,
    WheelsRefused,
    manifest,
    pick,
    read_manifest,
    simple_links,
)

MANIFEST = "manifest.json"
PYPI = "https://pypi.org/simple"
# A claim whose node has not reported for this long is not waited for (the node died mid-fetch).
CLAIM_STALE_S = 120.0
POLL_S = 0.5
# Wheels fetched at once, from a peer or the origin.
PARALLEL = 8
_PORT = re.compile(r"[0-9]{1,5}")

Say = Callable[[str], Awaitable[None]]
T = TypeVar("T")


class Share(Protocol):
    """What the installer service lends a gather: its node's claims, and the other nodes' statuses."""

    node: str

    async def claim(self, digest: str) -> float: ...

    async def release(self, digest: str) -> None: ...

    async def others(self) -> Mapping[str, NodeStatus]: ...


@dataclass(frozen=True)
class Plan:
    # (node, its wheel server's URL for the lock) of the nodes that hold the lock's wheels.
    peers: tuple[tuple[str, str], ...] = ()
    # A node that claimed the lock first and fetches it now: wait for it.
    wait_for: str = ""


def peer_url(status: NodeStatus, digest: str, url: str) -> bool:
    """Whether `url` is `http://<mgmt_addr>:<port>/wheels/<digest>/` on the node's own `mgmt_addr`
    (what its status says): a node never reads a URL a status invented elsewhere."""
    addr = status.facts.mgmt_addr
    if not addr:
        return False
    host = f"[{addr}]" if ":" in addr else addr
    head, tail = f"http://{host}:", f"/wheels/{digest}/"
    if not url.startswith(head) or not url.endswith(tail):
        return False
    port = url[len(head) : len(url) - len(tail)]
    return bool(_PORT.fullmatch(port)) and 0 < int(port) < 65536


def plan(digest: str, me: str, since: float, statuses: Mapping[str, NodeStatus], at: float) -> Plan:
    """Where this node gathers the lock `digest` from (pure): the nodes that hold it, else the
    node that claimed it first, else (an empty plan) the origin."""
    peers: list[tuple[str, str]] = []
    first: tuple[float, str] | None = None
    for node, status in sorted(statuses.items()):
        if node == me or status.node != node:
            continue
        for held in status.wheels:
            if held.lock != digest:
                continue
            if held.state == "held" and peer_url(status, digest, held.url):
                peers.append((node, held.url))
            elif (
                held.state == "fetching"
                and at - status.updated_at < CLAIM_STALE_S
                and (held.since, node) < (since, me)
                and (first is None or (held.since, node) < first)
            ):
                first = (held.since, node)
    if peers:
        return Plan(peers=tuple(peers))
    return Plan(wait_for=first[1] if first else "")


@dataclass
class Gather:
    """One gathering of one lock's wheels into `<wheel_root>/<digest>`."""

    lock: Lock
    digest: str
    wheel_root: Path
    origin: str
    client: httpx.AsyncClient
    share: Share | None
    say: Say
    wait_s: float = 600.0
    tags: tuple[Tag, ...] = ()
    origin_bytes: int = 0
    # Each read from a peer waits at most this long.
    read_s: float = 30.0

    @property
    def final(self) -> Path:
        return self.wheel_root / self.digest

    async def run(self) -> Path:
        """The lock's wheel directory, complete; DownloadError naming the wheel that no one had."""
        if (self.final / MANIFEST).is_file():
            return self.final
        tags = self.tags or tuple(sys_tags())
        partial = self.wheel_root / f"{self.digest}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            chosen = await self._from_peers(partial, tags)
            left = [p for p in self.lock.packages if p.name not in chosen]
            if left:
                chosen.update(await self._from_origin(partial, left, tags))
            (partial / MANIFEST).write_bytes(manifest(chosen.values()))
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(partial, self.final)
            return self.final
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            if self.share is not None:
                await self.share.release(self.digest)

    async def _from_peers(self, partial: Path, tags: tuple[Tag, ...]) -> dict[str, Offered]:
        """Claim the lock; read from each node that holds it (each node once); while a node that
        claimed it first fetches it, wait for it (at most `wait_s`). What no peer gave is left to
        the origin."""
        chosen: dict[str, Offered] = {}
        if self.share is None:
            return chosen
        since = await self.share.claim(self.digest)
        deadline = time.monotonic() + self.wait_s
        asked: set[str] = set()
        said = ""
        while len(chosen) < len(self.lock.packages):
            found = plan(self.digest, self.share.node, since, await self.share.others(), time.time())
            fresh = [(node, url) for node, url in found.peers if node not in asked]
            for node, url in fresh:
                asked.add(node)
                await self._from_peer(node, url, partial, tags, chosen)
            if fresh:
                continue
            if not found.wait_for or time.monotonic() > deadline:
                break
            if found.wait_for != said:
                said = found.wait_for
                await self.say(f"waiting for {said}, which fetches these wheels from the origin now")
            await anyio.sleep(POLL_S)
        return chosen

    async def _from_peer(
        self, node: str, url: str, partial: Path, tags: tuple[Tag, ...], chosen: dict[str, Offered]
    ) -> None:
        try:
            offered = read_manifest(await read_bounded(self.client, url + "manifest", MAX_MANIFEST_BYTES))
        except (WheelsRefused, DownloadError) as exc:
            await self.say(f"peer {node} was not used: its manifest: {exc}")
            return
        fits, _ = pick(self.lock, offered, tags)
        todo = [(p, fits[p.name]) for p in self.lock.packages if p.name in fits and p.name not in chosen]
        if not todo:
            return
        await self.say(f"fetching {wheels(len(todo))} from peer {node}")
        wrong: list[str] = []
        failed: list[InstallError] = []

        async def one(package: Package, o: Offered) -> None:
            if wrong or failed:
                return
            limit = min(o.size, MAX_WHEEL_BYTES)
            try:
                size = await anyio.to_thread.run_sync(
                    fetch_from_peer, url + o.sha256, partial / o.filename, package.hashes, limit, self.read_s
                )
            except WheelDiskError as exc:
                failed.append(exc)
                return
            except DownloadError as exc:
                wrong.append(f"{o.filename} ({exc})")
                return
            chosen[package.name] = Offered(o.filename, o.sha256, size=size)

        await each(todo, one)
        if failed:
            raise failed[0]
        if wrong:
            await self.say(f"peer {node} sent a wrong {wrong[0]}; discarded, not asked again")

    async def _from_origin(
        self, partial: Path, packages: list[Package], tags: tuple[Tag, ...]
    ) -> dict[str, Offered]:
        chosen: dict[str, Offered] = {}
        failed: list[InstallError] = []
        limit = self.lock.total_bytes or MAX_WHEEL_BYTES
        await self.say(f"fetching {wheels(len(packages))} from the origin")

        async def one(package: Package, _item: None) -> None:
            if failed:
                return
            page_url = f"{self.origin.rstrip('/')}/{canonicalize_name(package.name)}/"
            try:
                try:
                    page = await read_bounded(self.client, page_url, MAX_PAGE_BYTES, redirects=True)
                    links = simple_links(page, page_url)
                except WheelsRefused as exc:
                    raise DownloadError(f"{package.name}'s page at the index: {exc}") from exc
                fits, _ = pick(self.lock, links, tags)
                o = fits.get(package.name)
                if o is None:
                    raise DownloadError(
                        f"{page_url} has no wheel of {package.name} {package.version} with a sha256 the "
                        f"lock names for this Python ({tags[0] if tags else 'no tags'})"
                    )
                try:
                    size = await fetch_wheel(
                        self.client, o.url, partial / o.filename, package.hashes, limit, redirects=True
                    )
                except WheelDiskError:
                    raise
                except DownloadError as exc:
                    raise DownloadError(f"{o.url}: {exc}") from exc
            except InstallError as exc:
                failed.append(exc)
                return
            self.origin_bytes += size
            chosen[package.name] = Offered(o.filename, o.sha256, size=size)

        await each([(p, None) for p in packages], one)
        if failed:
            raise failed[0]
        return chosen


def wheels(n: int) -> str:
    return f"{n} wheel" + ("" if n == 1 else "s")


async def each(items: list[tuple[Package, T]], one: Callable[[Package, T], Awaitable[None]]) -> None:
    """`one` for every item, at most `PARALLEL` at once (a few wheels of a lock are most of its
    bytes, and one stream rarely fills a link)."""
    limiter = anyio.Semaphore(PARALLEL)

    async def limited(package: Package, item: T) -> None:
        async with limiter:
            await one(package, item)

    async with anyio.create_task_group() as tg:
        for package, item in items:
            tg.start_soon(limited, package, item)


def held_locks(wheel_root: Path) -> list[str]:
    """The locks whose wheels this node holds complete (a manifest written), newest first."""
    try:
        dirs = [d for d in wheel_root.iterdir() if re.fullmatch(r"[0-9a-f]{64}", d.name)]
    except OSError:
        return []
    done = [(d / MANIFEST).stat().st_mtime for d in dirs if (d / MANIFEST).is_file()]
    named = [d.name for d in dirs if (d / MANIFEST).is_file()]
    return [name for _, name in sorted(zip(done, named, strict=True), reverse=True)]


def remove_unwanted_wheels(wheel_root: Path, wanted: set[str]) -> list[str]:
    """Wheel directories of locks no longer wanted (and any left half-gathered); returns them."""
    removed = []
    try:
        entries = sorted(wheel_root.iterdir())
    except OSError:
        return []
    for d in entries:
        if d.name in wanted:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed
