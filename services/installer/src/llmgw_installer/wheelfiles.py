"""Which wheel file of each pinned package a node fetches, read from outside bytes (pure).

Wheel file names reach the node from an index's simple page or a peer's manifest: both are
hostile. A name is taken only if it is a plain wheel file name (`name-version-tags.whl`, at
most 255 characters, no path), of the package and version the lock pins, with a sha256 the
lock names for it and tags this node's Python installs; anything else is passed over. The
name is then only ever a file name inside the lock's wheel directory.

    simple_links(page, base)      an index's PEP 503 page: (file name, URL, sha256) per link
    read_manifest(data)           a peer's manifest: (file name, sha256, size) per wheel
    pick(lock, offered, tags)     for each package, the one file to fetch (or the packages
                                  nothing offered fits)
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from .errors import InstallError
from .lock import Lock, Package

# A simple page lists every file of every release: torch's is a few MB. Bigger is refused.
MAX_PAGE_BYTES = 32 * 2**20
MAX_LINKS = 100_000
# A manifest lists one wheel per package of one lock.
MAX_MANIFEST_BYTES = 2 * 2**20
MAX_MANIFEST_WHEELS = 4000
MAX_URL = 2048
# The largest wheel ever fetched (a CUDA library's wheel is a few GB).
MAX_WHEEL_BYTES = 16 * 2**30

_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+!-]{0,250}\.whl")
_SHA = re.compile(r"[0-9a-f]{64}")


class WheelsRefused(InstallError):
    """A simple page or a peer's manifest is not one llmgw reads; the message says what."""


@dataclass(frozen=True)
class Offered:
    """One wheel file someone offers: where to read it (a URL, or "" for a peer's by sha256)."""

    filename: str
    sha256: str
    url: str = ""
    size: int = 0


def plain_wheel_name(name: str) -> bool:
    """A wheel file name that is only a file name: never a path, a dot file or a control byte."""
    return bool(_FILE.fullmatch(name)) and ".." not in name


def wheel_of(filename: str, package: Package) -> frozenset[Tag] | None:
    """The file's tags if it is a plain wheel name of exactly `package`'s name and version."""
    if not plain_wheel_name(filename):
        return None
    try:
        name, version, _, tags = parse_wheel_filename(filename)
    except (InvalidWheelFilename, ValueError):
        return None
    if name != canonicalize_name(package.name):
        return None
    if str(version) != package.version and str(version).lower() != package.version.lower():
        return None
    return tags


def pick(
    lock: Lock, offered: Iterable[Offered], tags: Sequence[Tag]
) -> tuple[dict[str, Offered], list[Package]]:
    """For each package, the offered file this node installs: one of the lock's hashes, of its
    name and version, with the tag this Python ranks first. Returns them by package name, and
    the packages nothing offered fits."""
    rank = {tag: i for i, tag in enumerate(tags)}
    by_hash: dict[str, list[Offered]] = {}
    for o in offered:
        by_hash.setdefault(o.sha256, []).append(o)
    chosen: dict[str, Offered] = {}
    missing: list[Package] = []
    for package in lock.packages:
        best: tuple[int, Offered] | None = None
        for digest in package.hashes:
            for o in by_hash.get(digest, ()):
                wheel_tags = wheel_of(o.filename, package)
                if not wheel_tags:
                    continue
                score = min((rank[t] for t in wheel_tags if t in rank), default=-1)
                if score >= 0 and (best is None or score < best[0]):
                    best = (score, o)
        if best is None:
            missing.append(package)
        else:
            chosen[package.name] = best[1]
    return chosen, missing


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag != "a":
            return
        if len(self.hrefs) >= MAX_LINKS:
            raise WheelsRefused(f"the page has over {MAX_LINKS} links")
        href = dict(attrs).get("href")
        if href:
            self.hrefs.append(href)


def simple_links(page: bytes, base: str) -> list[Offered]:
    """The wheels a PEP 503 simple page links, each with the sha256 its URL's fragment names.

    A link without a sha256, not a plain wheel name, or not http(s) is passed over (the lock
    names every wheel's sha256: one without cannot be checked). WheelsRefused for a page over
    its bounds or not text."""
    if len(page) > MAX_PAGE_BYTES:
        raise WheelsRefused(f"the page is {len(page)} bytes; at most {MAX_PAGE_BYTES} are read")
    try:
        text = page.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WheelsRefused(f"the page is not UTF-8 text: {exc}") from exc
    parser = _Anchors()
    try:
        parser.feed(text)
        parser.close()
    except WheelsRefused:
        raise
    except Exception as exc:  # html.parser's own faults on hostile markup
        raise WheelsRefused(f"the page is not HTML: {type(exc).__name__}: {exc}") from exc
    found: list[Offered] = []
    for href in parser.hrefs:
        if len(href) > MAX_URL:
            continue
        try:
            url = urllib.parse.urljoin(base, href)
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            continue
        fragment = parts.fragment
        if parts.scheme not in ("http", "https") or not fragment.startswith("sha256="):
            continue
        digest = fragment[len("sha256=") :].lower()
        filename = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
        if not _SHA.fullmatch(digest) or not plain_wheel_name(filename):
            continue
        found.append(Offered(filename=filename, sha256=digest, url=url.split("#", 1)[0]))
    return found


def manifest(wheels: Iterable[Offered]) -> bytes:
    """What a node serves for a lock it holds: each wheel's file name, sha256 and size."""
    rows = [{"file": w.filename, "sha256": w.sha256, "size": w.size} for w in wheels]
    return json.dumps({"wheels": rows}, sort_keys=True).encode()


def read_manifest(data: bytes) -> list[Offered]:
    """A peer's manifest, checked: bounded, every name plain, every sha256 and size well formed.
    WheelsRefused says what is wrong; a peer that sends one is not asked again."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise WheelsRefused(f"the manifest is {len(data)} bytes; at most {MAX_MANIFEST_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise WheelsRefused(f"the manifest is not JSON: {str(exc)[:120]}") from exc
    rows = doc.get("wheels") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or len(rows) > MAX_MANIFEST_WHEELS:
        raise WheelsRefused(f"the manifest holds no list of at most {MAX_MANIFEST_WHEELS} wheels")
    found: list[Offered] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise WheelsRefused(f"wheel {i} of the manifest is not an object")
        name, digest, size = row.get("file"), row.get("sha256"), row.get("size")
        if not isinstance(name, str) or not plain_wheel_name(name):
            raise WheelsRefused(f"wheel {i} of the manifest has no plain wheel file name")
        if not isinstance(digest, str) or not _SHA.fullmatch(digest):
            raise WheelsRefused(f"wheel {i} of the manifest ({name}) has no sha256")
        if type(size) is not int or not 0 < size <= MAX_WHEEL_BYTES:
            raise WheelsRefused(f"wheel {i} of the manifest ({name}) has no size up to {MAX_WHEEL_BYTES}")
        found.append(Offered(filename=name, sha256=digest, size=size))
    return found
