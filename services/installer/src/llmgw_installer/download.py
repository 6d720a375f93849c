"""Streaming a build to the staging directory, hashing as it goes, with retries and backoff."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from .builds import Asset
from .errors import DownloadError
from .retry import OnRetry, retrying

Progress = Callable[[int, int], Awaitable[None]]


async def _fetch_once(client: httpx.AsyncClient, asset: Asset, dest: Path, progress: Progress) -> str:
    digest = hashlib.sha256()
    done = 0
    if asset.url.startswith("file://"):
        src = Path(urlparse(asset.url).path)
        try:
            f = src.open("rb")
        except OSError as exc:
            raise DownloadError(f"cannot read {src}: {exc.strerror}", retryable=False) from exc
        try:
            with f, dest.open("wb") as out:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            raise DownloadError(f"copying {src} to {dest}: {exc.strerror}", retryable=False) from exc
        return digest.hexdigest()
    total = 0
    try:
        async with client.stream("GET", asset.url, follow_redirects=True) as response:
            if response.status_code != 200:
                raise DownloadError(
                    f"GET {asset.url} answered {response.status_code}",
                    retryable=response.status_code >= 500 or response.status_code == 429,
                )
            length = response.headers.get("content-length") or ""
            total = int(length) if length.isdigit() else asset.size
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
    except OSError as exc:  # the node's own disk: full, read-only
        raise DownloadError(f"{asset.name}: cannot write {dest}: {exc.strerror}", retryable=False) from exc
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
    cap_s: float = 30.0,
    on_retry: OnRetry | None = None,
) -> str:
    """Download `asset` to `dest`; returns the sha256 of what arrived. Retries what retrying can fix."""
    return await retrying(
        lambda: _fetch_once(client, asset, dest, progress),
        attempts=attempts,
        backoff_s=backoff_s,
        cap_s=cap_s,
        on_retry=on_retry,
    )
