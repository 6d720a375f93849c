"""Where builds come from: a GitHub-shaped release API, or a mirror with a SHA256SUMS file.

Every asset must come with a sha256 (the release's `digest` field, a checksum
file in the release, or the mirror's SHA256SUMS); an asset without one is
refused: llmgw never installs what it cannot verify.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from .builds import Asset

CHECKSUM_FILES = ("SHA256SUMS", "sha256sum.txt", "checksums.txt")
_SUM_LINE = re.compile(r"^([0-9a-fA-F]{64})\s+\*?(\S+)$")


class SourceError(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def parse_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        m = _SUM_LINE.match(line.strip())
        if m:
            sums[Path(m.group(2)).name] = m.group(1).lower()
    return sums


async def github_assets(client: httpx.AsyncClient, api: str, repo: str, tag: str) -> list[Asset]:
    url = f"{api.rstrip('/')}/repos/{repo}/releases/tags/{tag}"
    try:
        response = await client.get(url, headers={"Accept": "application/vnd.github+json"})
    except httpx.HTTPError as exc:
        raise SourceError(f"cannot reach {url}: {exc}", retryable=True) from exc
    if response.status_code == 404:
        raise SourceError(f"release {tag} of {repo} not found at {url}", retryable=False)
    if response.status_code != 200:
        raise SourceError(f"{url} answered {response.status_code}", retryable=response.status_code >= 500)
    body = response.json()
    raw = body.get("assets", []) if isinstance(body, dict) else []
    assets = [
        Asset(
            name=str(a.get("name", "")),
            url=str(a.get("browser_download_url", "")),
            size=int(a.get("size") or 0),
            sha256=str(a.get("digest") or "").removeprefix("sha256:").lower(),
        )
        for a in raw
        if isinstance(a, dict)
    ]
    missing = [a for a in assets if not a.sha256]
    if missing:
        sums_asset = next(
            (a for a in assets if a.name in CHECKSUM_FILES or a.name.endswith(".sha256sums")), None
        )
        sums: dict[str, str] = {}
        if sums_asset is not None:
            try:
                r = await client.get(sums_asset.url, follow_redirects=True)
                if r.status_code == 200:
                    sums = parse_sums(r.text)
            except httpx.HTTPError as exc:
                raise SourceError(f"cannot fetch {sums_asset.name}: {exc}", retryable=True) from exc
        assets = [a if a.sha256 else Asset(a.name, a.url, a.size, sums.get(a.name, "")) for a in assets]
    return assets


async def mirror_assets(client: httpx.AsyncClient, mirror: str) -> list[Asset]:
    """A directory or URL holding the archives and a SHA256SUMS file."""
    if mirror.startswith(("http://", "https://")):
        base = mirror.rstrip("/")
        try:
            r = await client.get(f"{base}/SHA256SUMS")
        except httpx.HTTPError as exc:
            raise SourceError(f"cannot reach mirror {base}: {exc}", retryable=True) from exc
        if r.status_code != 200:
            raise SourceError(
                f"mirror {base}/SHA256SUMS answered {r.status_code}", retryable=r.status_code >= 500
            )
        return [
            Asset(name, f"{base}/{name}", 0, digest) for name, digest in sorted(parse_sums(r.text).items())
        ]
    root = Path(mirror)
    sums_path = root / "SHA256SUMS"
    try:
        sums = parse_sums(sums_path.read_text())
    except OSError as exc:
        raise SourceError(f"mirror {root}: cannot read SHA256SUMS: {exc.strerror}", retryable=False) from exc
    return [Asset(name, (root / name).as_uri(), 0, digest) for name, digest in sorted(sums.items())]
