"""Where builds come from: a GitHub-shaped release API, or a mirror with a SHA256SUMS file.

Every asset must come with a sha256 (the release's `digest` field, a checksum
file in the release, or the mirror's SHA256SUMS); an asset without one is
refused: llmgw never installs what it cannot verify.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import msgspec

from .builds import Asset
from .errors import SourceError
from .retry import OnRetry, retrying

CHECKSUM_FILES = ("SHA256SUMS", "sha256sum.txt", "checksums.txt")
_SUM_LINE = re.compile(r"^([0-9a-fA-F]{64})\s+\*?(\S+)$")


class _ReleaseAsset(msgspec.Struct):
    name: str
    browser_download_url: str = ""
    size: int | None = None
    digest: str | None = None


class _Release(msgspec.Struct):
    assets: list[_ReleaseAsset] = []


_release = msgspec.json.Decoder(_Release)


DEFAULT_SOURCE = "github:ggml-org/llama.cpp"
CONFIGURED = "configured"


def parse_source(source: str) -> tuple[str, str]:
    """An EngineSpec's `source` as (kind, where): `github`/`owner/repo`, `mirror`/`url or dir`,
    or `configured`/`` (the engine is the one agent.yaml names; nothing is downloaded)."""
    source = source or DEFAULT_SOURCE
    if source == CONFIGURED:
        return CONFIGURED, ""
    kind, _, where = source.partition(":")
    owner, _, repo = where.partition("/")
    if kind == "github" and all(re.fullmatch(r"[\w.-]+", p) and p not in (".", "..") for p in (owner, repo)):
        return kind, where
    if kind == "mirror" and where:
        return kind, where
    raise SourceError(
        f"source {source!r} is not one llmgw knows; use github:<owner>/<repo>, "
        "mirror:<url or directory>, or configured (the path named under engines: in agent.yaml)"
    )


def parse_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        m = _SUM_LINE.match(line.strip())
        if m:
            sums[Path(m.group(2)).name] = m.group(1).lower()
    return sums


async def _get(client: httpx.AsyncClient, url: str, what: str, **kw: object) -> httpx.Response:
    """One GET; refused connections, timeouts and 5xx/429 answers are retryable SourceErrors."""
    try:
        response = await client.get(url, **kw)  # type: ignore[arg-type]
    except httpx.TimeoutException as exc:
        raise SourceError(
            f"{what} {url} did not answer in time ({type(exc).__name__})", retryable=True
        ) from exc
    except httpx.HTTPError as exc:
        raise SourceError(f"cannot reach {what} {url}: {exc}", retryable=True) from exc
    if response.status_code >= 500 or response.status_code == 429:
        raise SourceError(f"{what} {url} answered {response.status_code}", retryable=True)
    return response


async def github_assets(
    client: httpx.AsyncClient,
    api: str,
    repo: str,
    tag: str,
    *,
    attempts: int = 3,
    backoff_s: float = 1.0,
    cap_s: float = 30.0,
    on_retry: OnRetry | None = None,
) -> list[Asset]:
    """The release's assets, each with its sha256 where the release publishes one."""
    url = f"{api.rstrip('/')}/repos/{repo}/releases/tags/{tag}"

    async def lookup() -> httpx.Response:
        return await _get(client, url, "release API", headers={"Accept": "application/vnd.github+json"})

    response = await retrying(lookup, attempts=attempts, backoff_s=backoff_s, cap_s=cap_s, on_retry=on_retry)
    if response.status_code == 404:
        raise SourceError(f"release {tag} of {repo} not found at {url}", retryable=False)
    if response.status_code != 200:
        raise SourceError(f"{url} answered {response.status_code}", retryable=False)
    try:
        release = _release.decode(response.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SourceError(
            f"{url} answered with a release that does not decode: {exc}", retryable=False
        ) from exc
    assets = [
        Asset(
            name=a.name,
            url=a.browser_download_url,
            size=max(0, a.size or 0),
            sha256=(a.digest or "").removeprefix("sha256:").lower(),
        )
        for a in release.assets
    ]
    missing = [a for a in assets if not a.sha256]
    if missing:
        sums_asset = next(
            (a for a in assets if a.name in CHECKSUM_FILES or a.name.endswith(".sha256sums")), None
        )
        sums: dict[str, str] = {}
        if sums_asset is not None:

            async def fetch_sums() -> httpx.Response:
                assert sums_asset is not None
                return await _get(client, sums_asset.url, sums_asset.name, follow_redirects=True)

            r = await retrying(
                fetch_sums, attempts=attempts, backoff_s=backoff_s, cap_s=cap_s, on_retry=on_retry
            )
            if r.status_code == 200:
                sums = parse_sums(r.text)
        assets = [a if a.sha256 else Asset(a.name, a.url, a.size, sums.get(a.name, "")) for a in assets]
    return assets


async def mirror_assets(
    client: httpx.AsyncClient,
    mirror: str,
    *,
    attempts: int = 3,
    backoff_s: float = 1.0,
    cap_s: float = 30.0,
    on_retry: OnRetry | None = None,
) -> list[Asset]:
    """A directory or URL holding the archives and a SHA256SUMS file."""
    if mirror.startswith(("http://", "https://")):
        base = mirror.rstrip("/")

        async def lookup() -> httpx.Response:
            return await _get(client, f"{base}/SHA256SUMS", "mirror")

        r = await retrying(lookup, attempts=attempts, backoff_s=backoff_s, cap_s=cap_s, on_retry=on_retry)
        if r.status_code != 200:
            raise SourceError(f"mirror {base}/SHA256SUMS answered {r.status_code}", retryable=False)
        return [
            Asset(name, f"{base}/{name}", 0, digest) for name, digest in sorted(parse_sums(r.text).items())
        ]
    root = Path(mirror)
    sums_path = root / "SHA256SUMS"
    try:
        sums = parse_sums(sums_path.read_bytes().decode("utf-8", "replace"))
    except OSError as exc:
        raise SourceError(f"mirror {root}: cannot read SHA256SUMS: {exc.strerror}", retryable=False) from exc
    return [Asset(name, (root / name).as_uri(), 0, digest) for name, digest in sorted(sums.items())]
