"""Streaming a build to the staging directory, hashing as it goes, with retries and backoff."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse

import anyio
import httpx

from .builds import Asset

Progress = Callable[[int, int], Awaitable[None]]


class DownloadError(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


async def _fetch_once(client: httpx.AsyncClient, asset: Asset, dest: Path, progress: Progress) -> str:
    digest = hashlib.sha256()
    done = 0
    if asset.url.startswith("file://"):
        src = Path(urlparse(asset.url).path)
        try:
            with src.open("rb") as f, dest.open("wb") as out:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            raise DownloadError(f"cannot read {src}: {exc.strerror}", retryable=False) from exc
        return digest.hexdigest()
    try:
        async with client.stream("GET", asset.url, follow_redirects=True) as response:
            if response.status_code != 200:
                raise DownloadError(
                    f"GET {asset.url} answered {response.status_code}",
                    retryable=response.status_code >= 500 or response.status_code == 429,
                )
            total = int(response.headers.get("content-length") or asset.size or 0)
            with dest.open("wb") as out:
                async for chunk in response.aiter_bytes(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    await progress(done, total)
    except httpx.TimeoutException as exc:
        raise DownloadError(
            f"{asset.name}: the server stopped sending ({type(exc).__name__}) after {done} bytes",
            retryable=True,
        ) from exc
    except httpx.HTTPError as exc:
        raise DownloadError(
            f"{asset.name}: transfer failed after {done} bytes: {exc}", retryable=True
        ) from exc
    expected = asset.size or total
    if expected and done != expected:
        raise DownloadError(f"{asset.name}: truncated: got {done} of {expected} bytes", retryable=True)
    return digest.hexdigest()


async def download(
    client: httpx.AsyncClient,
    asset: Asset,
    dest: Path,
    progress: Progress,
    *,
    attempts: int = 3,
    backoff_s: float = 1.0,
    on_retry: Callable[[int, DownloadError], Awaitable[None]] | None = None,
) -> str:
    """Download `asset` to `dest`; returns the sha256 of what arrived. Retries what retrying can fix."""
    for attempt in range(1, attempts + 1):
        try:
            return await _fetch_once(client, asset, dest, progress)
        except DownloadError as exc:
            if not exc.retryable or attempt == attempts:
                if exc.retryable:
                    raise DownloadError(f"{exc} (gave up after {attempts} attempts)", retryable=True) from exc
                raise
            if on_retry is not None:
                await on_retry(attempt, exc)
            await anyio.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")
