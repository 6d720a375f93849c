"""Bytes of an engine lock's wheels over HTTP, each bounded and hashed as it arrives (`wheels.py`
decides where from).

    read_bounded      a small document (an index's page, a peer's manifest), to a limit
    fetch_wheel       a wheel from the index (httpx: proxies, TLS and redirects as the node has them)
    fetch_from_peer   a wheel from a peer (plain http on the nodes' own network), in a thread

A wheel is written to `<name>.part` beside where it goes, and renamed there only once its
sha256 is one the lock names; on any failure the `.part` file is removed. DownloadError says
what the sender did wrong; WheelDiskError that this node could not write.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.parse
from pathlib import Path

import httpx

from .errors import DownloadError, InstallError
from .wheelfiles import WheelsRefused

CHUNK = 1 << 20
# A peer that sends a wheel slower than this on average, after the grace, is left for another.
MIN_PEER_RATE = 1_000_000
SLOW_GRACE_S = 60.0


class WheelDiskError(InstallError):
    """This node cannot write a wheel it fetched (a full or read-only disk): no peer's fault."""


async def read_bounded(client: httpx.AsyncClient, url: str, limit: int, *, redirects: bool = False) -> bytes:
    """A small document (a simple page, a manifest) read to at most `limit` bytes, decoded
    (indexes gzip their pages; the decoded bytes are what is bounded)."""
    try:
        async with client.stream("GET", url, follow_redirects=redirects) as resp:
            if resp.status_code != 200:
                raise DownloadError(f"{url}: HTTP {resp.status_code}")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise WheelsRefused(f"{url}: over {limit} bytes")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise DownloadError(f"{url}: {type(exc).__name__}: {exc}") from exc


async def fetch_wheel(
    client: httpx.AsyncClient,
    url: str,
    dest: Path,
    hashes: tuple[str, ...],
    limit: int,
    *,
    redirects: bool = False,
) -> int:
    """One wheel to `dest`: at most `limit` bytes, its sha256 one of `hashes`, else nothing is
    left and DownloadError says why (WheelDiskError where this node cannot write it). The bytes
    hashed are the bytes sent: `identity`, never a content encoding. Returns its size."""
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    size = 0
    try:
        async with client.stream(
            "GET", url, headers={"Accept-Encoding": "identity"}, follow_redirects=redirects
        ) as resp:
            if resp.status_code != 200:
                raise DownloadError(f"HTTP {resp.status_code}")
            with part.open("wb") as out:
                async for chunk in resp.aiter_raw(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise DownloadError(f"sent over {limit} bytes")
                    digest.update(chunk)
                    out.write(chunk)
        got = digest.hexdigest()
        if got not in hashes:
            raise DownloadError(f"sha256 {got}, the lock says {' or '.join(hashes)}")
        os.replace(part, dest)
        return size
    except OSError as exc:  # the node's own disk: full, read-only
        raise WheelDiskError(f"cannot write {dest}: {exc.strerror}") from exc
    except httpx.HTTPError as exc:
        raise DownloadError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        part.unlink(missing_ok=True)


def fetch_from_peer(url: str, dest: Path, hashes: tuple[str, ...], limit: int, timeout: float) -> int:
    """A peer's wheel to `dest`, as `fetch_wheel`, in a worker thread: plain http on the nodes'
    own network, read straight into one buffer (the async client's parsing held a peer's
    transfer under 100 MB/s, below what a node's network carries). A peer must keep up
    `MIN_PEER_RATE` once `SLOW_GRACE_S` have passed: one that trickles is left for another."""
    parts = urllib.parse.urlsplit(url)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    started = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        try:
            conn.request("GET", parts.path, headers={"Accept-Encoding": "identity"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise DownloadError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status != 200:
            raise DownloadError(f"HTTP {resp.status}")
        try:
            out = part.open("wb")
        except OSError as exc:
            raise WheelDiskError(f"cannot write {dest}: {exc.strerror}") from exc
        with out:
            while True:
                try:
                    n = resp.readinto(buf)
                except (OSError, http.client.HTTPException) as exc:
                    raise DownloadError(f"stopped after {size} bytes: {type(exc).__name__}: {exc}") from exc
                if not n:
                    break
                size += n
                if size > limit:
                    raise DownloadError(f"sent over {limit} bytes")
                took = time.monotonic() - started
                if took > SLOW_GRACE_S and size < took * MIN_PEER_RATE:
                    raise DownloadError(f"sent {size} bytes in {took:.0f} s, under {MIN_PEER_RATE} bytes/s")
                digest.update(view[:n])
                try:
                    out.write(view[:n])
                except OSError as exc:
                    raise WheelDiskError(f"cannot write {dest}: {exc.strerror}") from exc
        got = digest.hexdigest()
        if got not in hashes:
            raise DownloadError(f"sha256 {got}, the lock says {' or '.join(hashes)}")
        os.replace(part, dest)
        return size
    finally:
        conn.close()
        part.unlink(missing_ok=True)
