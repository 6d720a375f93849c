"""The node's weights: staged in `<state_dir>/models` before a shard's engine starts.

    WeightsError(reason, retryable)   every way staging fails, in the node's words;
                                      the runner turns it into the attempt's Failure

On disk (one filesystem, so that every commit is a rename or a hard link):

    models/blobs/sha256-<hex>                   a verified file, named by its content
    models/blobs/gitsha1-<hex>                  a small hub file (not LFS), named by its git blob id
    models/blobs/<blob>.partial                 a download under way; the next attempt resumes it (Range)
    models/hf/<org>/<repo>/<commit>/files/<f>   one file of a repository: a hard link to its blob
    models/hf/<org>/<repo>/<commit>/snapshot/   a whole repository, renamed into place once every file is in
    models/hf/<org>/<repo>/refs/<revision>      the commit a branch or tag resolved to when last staged
    models/url/<sha256>/<name>                  a file from a URL

Nothing an engine reads is ever half-written: a blob is renamed from its `.partial` only after its
bytes were counted, hashed against what the hub (or `model_sha256`) states, and fsynced, and a view
appears only by a rename of links to such blobs. One download per blob per node: shards that want the
same model wait on the same lock and find it staged; their status shows the download's progress.

The hub protocol (URLs, headers, HF_ENDPOINT, HF_TOKEN, the metadata and its errors) is
huggingface_hub's; the bytes are fetched here, so that they are hashed while they arrive, resume
from a `.partial` the node owns, and report progress in the node's words.

Whatever a hub, a mirror or a peer answers is checked before it names a path: a commit is 40 hex
digits, a digest its algorithm's number of hex digits, a size a bounded non-negative integer, a
file name a plain relative path (`llmgw_core.sources.path_problem`), a repository's listing
bounded in bytes and files, a redirect an http(s) URL, a few at most. Every path is then resolved
(links too) and proven inside the models directory before anything is written or linked there.
A hub answer that fails a check fails the staging of that model, not retryable, with the hub,
the field and the value named.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import anyio
import httpx
import msgspec
from anyio import CapacityLimiter

from llmgw_core.engines import ModelSource
from llmgw_core.fit import FitError, read_shape
from llmgw_core.sources import is_commit, is_sha256, path_problem, shown, url_problem
from llmgw_core.staged import hf_dir, hf_view, shape_file, url_view

from .peers import Peers

log = logging.getLogger("llmgw.launcher.weights")

CHUNK = 1 << 20
# At most this many files download at once on a node (each in a thread of its own).
DOWNLOAD_THREADS = 4
# A status with the download's progress is published at most this often.
PROGRESS_INTERVAL_S = 1.0

Algo = Literal["sha256", "gitsha1"]

# What a hub's answer may hold. A hostile hub or mirror can answer anything; these bound what
# the node reads of it and believes.
MAX_LISTING_BYTES = 32 << 20  # a repository's file listing (a real one of 10,000 files: ~3 MB)
MAX_LISTING_FILES = 10_000
MAX_ERROR_BYTES = 64 << 10  # the body of an error answer, read for its message
MAX_FILE_BYTES = 1 << 42  # 4.4 TB: no one file of a model is bigger
MAX_MODEL_BYTES = 1 << 46  # 70 TB: all the files of one repository
# Redirects followed while downloading one file (the hub sends one, to its CDN).
MAX_REDIRECTS = 5

# A peer is another node on the cluster's own network: one that sends less than this,
# averaged over each window of the read timeout, is left for the next peer or the origin
# (a byte every 29 s would otherwise hold a transfer open forever under a 30 s timeout).
PEER_MIN_BYTES_PER_S = 256 * 1024
_DIGEST_CHARS: dict[Algo, int] = {"sha256": 64, "gitsha1": 40}
_HEX = frozenset("0123456789abcdef")


class WeightsError(Exception):
    """Staging failed; `retryable` says whether another attempt can help (a 404 cannot)."""

    def __init__(self, reason: str, retryable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True)
class Want:
    """One file to stage: where it is, how big, and the digest it must have."""

    name: str
    url: str
    size: int
    algo: Algo
    digest: str
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def blob(self) -> str:
        return f"{self.algo}-{self.digest}"


@dataclass(frozen=True)
class Plan:
    """A source resolved: what it is called in the node's words, its files, where the engine reads it."""

    label: str
    view: Path
    files: tuple[Want, ...]
    snapshot: bool
    ref: Path | None = None
    commit: str = ""


@dataclass
class Progress:
    """A staging as the shards that wait for it describe it; written by the download thread."""

    label: str
    phase: str = "resolving"
    file: str = ""
    done: int = 0
    total: int = 0
    # The peer the bytes come from ("": the origin).
    via: str = ""

    def words(self) -> str:
        if self.phase == "downloading" and self.total:
            pct = int(self.done * 100 / self.total)
            source = f" from {self.via}" if self.via else ""
            return (
                f"weights {self.label}: downloading {self.file}{source} "
                f"({pct}%, {amount(self.done, self.total)})"
            )
        if self.phase == "resolving" and self.total:
            pct = int(self.done * 100 / self.total)
            return (
                f"weights {self.label}: resolving again ({self.file}: {pct}%, "
                f"{amount(self.done, self.total)} here, resumed from there)"
            )
        target = f" {self.file}" if self.file and self.phase != "resolving" else ""
        return f"weights {self.label}: {self.phase}{target}"


def amount(done: int, total: int) -> str:
    """`5.1 of 13.4 GB`: both in the unit the total reads best in."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if total >= size:
            return f"{done / size:.1f} of {total / size:.1f} {unit}"
    return f"{done} of {total} bytes"


def size_words(n: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


@dataclass
class _Reservation:
    """The bytes a download under way still needs: what it needed at its start, less what came
    (`base`: the bytes of the model that were here before it started)."""

    need: int
    progress: Progress
    base: int
    plan: Plan

    def outstanding(self) -> int:
        return max(0, self.need - max(0, self.progress.done - self.base))


def _promised(promised: int) -> str:
    return f" ({size_words(promised)} more kept for downloads under way)" if promised else ""


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


@dataclass
class Weights:
    """The node's store of staged weights. One per launcher; every runner shares it."""

    root: Path
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # Seconds without a byte (or a metadata answer) before a download is given up for this attempt.
    timeout_s: float = 30.0
    # Bytes the store may hold in all (0: as much as the disk has free).
    budget_bytes: int = 0
    # Free space on the store's disk; a seam for tests that need a full disk.
    free: Callable[[Path], int] = free_bytes
    progress_interval_s: float = PROGRESS_INTERVAL_S
    # The sources the node's shards want (read on the event loop): their models are never evicted.
    in_use: Callable[[], list[ModelSource]] = list
    # Told of each model evicted to make room (on the event loop).
    on_evict: Callable[[Eviction], None] = lambda _e: None
    _evicted: list[Eviction] = field(default_factory=list)
    # The other nodes of the cluster, asked for each file before the origin (None: origin only).
    peers: Peers | None = None
    _locks: dict[str, anyio.Lock] = field(default_factory=dict)
    _progress: dict[str, Progress] = field(default_factory=dict)
    _blob_locks: dict[str, threading.Lock] = field(default_factory=dict)
    _threads: CapacityLimiter = field(default_factory=lambda: CapacityLimiter(DOWNLOAD_THREADS))
    _swept: bool = False
    _sweep_lock: threading.Lock = field(default_factory=threading.Lock)
    # Downloads under way on this node: the bytes each still needs (see `_check_disk`).
    _reserved: dict[str, _Reservation] = field(default_factory=dict)
    _reserve_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    async def stage(self, source: ModelSource, report: Callable[[str], None]) -> Path:
        """The local path of `source`'s weights, staged first if need be; `report` hears the progress."""
        if source.kind == "file":
            if not await anyio.to_thread.run_sync(os.path.exists, source.path):
                raise WeightsError(f"model file not found: {source.path}", retryable=False)
            return Path(source.path)
        key = str(source)
        lock = self._locks.setdefault(key, anyio.Lock())
        progress = self._progress.setdefault(key, Progress(label=source.name))
        outcome: list[Path | WeightsError] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._report, progress, report)
            try:
                async with lock:
                    # A snapshot taken here, on the loop: the launcher changes its shards meanwhile.
                    keep = [s for s in self.in_use() if s.kind != "file"] + [source]
                    outcome.append(await self._stage(source, progress, keep))
            except WeightsError as exc:  # raised here, not as a group: the runner reads its flag
                outcome.append(exc)
            finally:
                self._tell_evictions()
            tg.cancel_scope.cancel()
        if isinstance(outcome[0], WeightsError):
            raise outcome[0]
        return outcome[0]

    def _tell_evictions(self) -> None:
        while self._evicted:
            eviction = self._evicted.pop(0)
            log.info("%s", eviction.words)
            try:
                self.on_evict(eviction)
            except Exception:  # telling of it must not fail the staging that made the room
                log.exception("cannot tell of the eviction of %s", eviction.key)

    async def _report(self, progress: Progress, report: Callable[[str], None]) -> None:
        """The progress, when it changed, at most once an interval: a download of many GB must not
        write the status bucket at the rate its chunks arrive."""
        last = ""
        while True:
            words = progress.words()
            if words != last:
                report(words)
                last = words
            await anyio.sleep(self.progress_interval_s)

    async def _stage(self, source: ModelSource, progress: Progress, keep: list[ModelSource]) -> Path:
        stop = threading.Event()
        try:
            return await anyio.to_thread.run_sync(
                self._stage_sync, source, progress, stop, keep, abandon_on_cancel=True, limiter=self._threads
            )
        finally:
            # A cancelled attempt's thread stops at its next chunk; the `.partial` stays for the next.
            stop.set()

    # --- in a thread of its own -------------------------------------------------------------------

    def _stage_sync(
        self, source: ModelSource, progress: Progress, stop: threading.Event, keep: list[ModelSource]
    ) -> Path:
        try:
            return self._stage_files(source, progress, stop, keep)
        except OSError as exc:
            # A disk that filled under the store (another process wrote to it), a store made
            # read-only: the attempt's failure in the node's words, never a launcher error.
            where = f" {exc.filename}" if exc.filename else f" in {self.root}"
            raise WeightsError(
                f"weights {progress.label}: cannot write{where}: {exc.strerror or exc}; "
                "nothing half-written is used, and the next attempt tries again"
            ) from exc

    def _stage_files(
        self, source: ModelSource, progress: Progress, stop: threading.Event, keep: list[ModelSource]
    ) -> Path:
        self._sweep()
        staged = self._already_staged(source)
        if staged is not None:
            _touch(staged)
            _record_shape(staged)
            return staged
        if progress.phase == "downloading" and progress.done:
            # Again, after an attempt that broke off: what came then is still here (resumed),
            # and its shards keep saying how far it got, never `resolving` from nothing.
            progress.phase = "resolving"
        else:
            progress.label, progress.phase, progress.file = source.name, "resolving", ""
            progress.done = progress.total = 0
        try:
            plan = resolve(source, self.root, self.environ, self.timeout_s)
        except WeightsError as exc:
            # The hub is away: a branch staged before is still what this node last verified.
            fallback = self._by_ref(source) if exc.retryable else None
            if fallback is None:
                raise
            log.warning("%s; using %s, staged when the hub last answered", exc.reason, fallback)
            _touch(fallback)
            _record_shape(fallback)
            return fallback
        progress.label = plan.label
        self._check_plan(plan)
        if not plan.view.exists():
            key = f"{plan.view}"
            self._check_disk(plan, key, progress, keep)
            try:
                self._download(plan, progress, stop)
            finally:
                with self._reserve_lock:
                    self._reserved.pop(key, None)
            progress.phase, progress.file = "committing", ""
            self._commit(plan)
        if plan.ref is not None:
            _write_atomic(plan.ref, plan.commit.encode())
        _touch(plan.view)
        _record_shape(plan.view)
        return plan.view

    def _sweep(self) -> None:
        """Once per launcher, before its first commit: what a launcher that died mid-commit left
        (a half-linked snapshot in `.staging`, a link not yet renamed) goes. `.partial` downloads
        stay: they are resumed."""
        with self._sweep_lock:
            if self._swept:
                return
            self._swept = True
            shutil.rmtree(self.root / ".staging", ignore_errors=True)
            for tmp in self.root.glob("*/**/.*.tmp"):
                tmp.unlink(missing_ok=True)

    def _already_staged(self, source: ModelSource) -> Path | None:
        """A pinned source (a commit, a sha256) staged before: no need to ask anyone."""
        if source.kind == "url":
            view = _inside(self.root, url_view(self.root, source), source.name)
            return view if view.exists() else None
        if source.pinned:
            view = _inside(self.root, hf_view(self.root, source, source.revision), source.name)
            return view if view.exists() else None
        return None

    def _by_ref(self, source: ModelSource) -> Path | None:
        if source.kind != "hf":
            return None
        ref = _inside(self.root, hf_dir(self.root, source) / "refs" / source.revision, source.name)
        try:
            with ref.open("rb") as f:
                commit = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            return None
        if not is_commit(commit):  # a ref this node did not write: not evidence of anything staged
            return None
        view = _inside(self.root, hf_view(self.root, source, commit), source.name)
        return view if view.exists() else None

    def _check_plan(self, plan: Plan) -> None:
        """Every path the plan writes or links, resolved (links too) and proven inside the store,
        before the first byte: a name that passed every check but leads through a link planted
        under the store must not write outside it either."""
        for path in (plan.view, plan.ref, self.blobs, *(self.blobs / w.blob for w in plan.files)):
            if path is not None:
                _inside(self.root, path, plan.label)
        if plan.snapshot:
            for want in plan.files:
                _inside(self.root, plan.view / want.name, plan.label)

    def _check_disk(self, plan: Plan, key: str, progress: Progress, keep: list[ModelSource]) -> None:
        """Refuse before the first byte when the rest of the download cannot fit, after evicting
        what no shard uses; else reserve the bytes.

        Two downloads that start together each see the same free space: without the
        reservation both would pass the check and the second would fill the disk midway.
        The bytes other downloads under way still need count as taken.
        """
        need = 0
        for want in plan.files:
            if (self.blobs / want.blob).exists():
                continue
            need += want.size - _size(self.blobs / f"{want.blob}.partial")
        if need <= 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with self._reserve_lock:
            busy = {w.blob for r in self._reserved.values() for w in r.plan.files} | {
                w.blob for w in plan.files
            }
            candidates: list[Staged] | None = None
            while True:
                promised = sum(r.outstanding() for k, r in self._reserved.items() if k != key)
                free = self.free(self.root) - promised
                left = self.budget_bytes - _tree_size(self.root) - promised if self.budget_bytes > 0 else need
                if need <= free and need <= left:
                    break
                if candidates is None:
                    candidates = evictable(staged_views(self.root), keep)
                if not candidates:
                    if need > free:
                        raise WeightsError(
                            f"weights {plan.label}: needs {size_words(need)}, {size_words(max(0, free))} "
                            f"free on {self.root}{_promised(promised)}; "
                            "free space there (or stage the model elsewhere and use file://)"
                        )
                    raise WeightsError(
                        f"weights {plan.label}: needs {size_words(need)}, {size_words(max(0, left))} left "
                        f"of the node's {size_words(self.budget_bytes)} for weights on {self.root}"
                        f"{_promised(promised)}; raise models_budget_bytes or remove staged models"
                    )
                victim = candidates.pop(0)
                freed = self._evict(victim, busy)
                self._evicted.append(
                    Eviction(
                        key=victim.key,
                        path=victim.path,
                        freed=freed,
                        used_at=victim.used_at,
                        words=(
                            f"weights {victim.key}: evicted from {self.root} ({size_words(freed)} freed): "
                            f"no shard of this node uses it, it was the least recently used, and "
                            f"{plan.label} needs {size_words(need)}"
                        ),
                    )
                )
            # The progress counts every byte of the model, those already here too.
            self._reserved[key] = _Reservation(need, progress, sum(w.size for w in plan.files) - need, plan)

    def _evict(self, victim: Staged, busy: set[str]) -> int:
        """Remove one view, then the blobs only it held: the view goes first, by a rename, so an
        engine never finds half a model. Blobs a staging under way wants stay."""
        inodes = {p.stat().st_ino for p in _files_of(victim.path)}
        gone = self.root / ".staging" / f"evict-{uuid.uuid4().hex}"
        gone.parent.mkdir(parents=True, exist_ok=True)
        os.rename(victim.path, gone)
        _marker(victim.path).unlink(missing_ok=True)
        shape_file(victim.path).unlink(missing_ok=True)
        _fsync_dir(victim.path.parent)
        if gone.is_dir():
            shutil.rmtree(gone, ignore_errors=True)
        else:
            gone.unlink(missing_ok=True)
        _prune_empty(victim.path.parent, self.root)
        freed = 0
        for blob in self.blobs.iterdir() if self.blobs.is_dir() else ():
            try:
                st = blob.stat()
            except OSError:
                continue
            if st.st_ino in inodes and st.st_nlink == 1 and blob.name not in busy:
                blob.unlink(missing_ok=True)
                freed += st.st_size
        return freed

    def _download(self, plan: Plan, progress: Progress, stop: threading.Event) -> None:
        self.blobs.mkdir(parents=True, exist_ok=True)
        progress.total = sum(w.size for w in plan.files)
        progress.done = 0
        for want in plan.files:
            progress.file = want.name
            lock = self._blob_locks.setdefault(want.blob, threading.Lock())
            with lock:
                if (self.blobs / want.blob).exists():
                    progress.done += want.size
                    continue
                progress.phase = "downloading"
                self._fetch(want, plan.label, progress, stop)

    def _fetch(self, want: Want, label: str, progress: Progress, stop: threading.Event) -> None:
        """One file: from a peer that holds or fetches it, else from the origin; whoever sent
        the bytes, they are verified against the digest this node resolved itself."""
        peers = self.peers
        if peers is None:
            fetch(want, self.blobs, label, progress, stop, self.timeout_s)
            return
        base = progress.done
        tried: set[str] = set()
        peers.begin(want.blob, want.size)
        try:
            while True:
                offer = peers.choose(want.blob, want.size, tried)
                progress.via = "" if offer is None else offer.node
                if offer is None:
                    fetch(want, self.blobs, label, progress, stop, self.timeout_s)
                    return
                via = replace(want, url=offer.url, headers=(("Authorization", f"Bearer {offer.token}"),))
                try:
                    fetch(via, self.blobs, label, progress, stop, self.timeout_s, peer=offer.node)
                    return
                except WeightsError as exc:
                    if stop.is_set():
                        raise
                    log.warning("%s; asking the other nodes again, then the origin", exc.reason)
                    tried.add(offer.node)
                    progress.done = base
                    peers.again(want.blob)
        finally:
            progress.via = ""
            peers.end(want.blob)

    def _commit(self, plan: Plan) -> None:
        """The view appears whole, by one rename, or not at all."""
        view = _inside(self.root, plan.view, plan.label)
        view.parent.mkdir(parents=True, exist_ok=True)
        if not plan.snapshot:
            tmp = view.parent / f".{view.name}.{uuid.uuid4().hex}.tmp"
            os.link(self.blobs / plan.files[0].blob, tmp)
            os.replace(tmp, view)
            _fsync_dir(view.parent)
            return
        staging = self.root / ".staging" / uuid.uuid4().hex
        try:
            for want in plan.files:
                target = _inside(self.root, staging / want.name, plan.label)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(self.blobs / want.blob, target)
            for d in sorted({(staging / w.name).parent for w in plan.files}, reverse=True):
                _fsync_dir(d)
            try:
                os.rename(staging, view)
            except OSError:
                if not view.exists():
                    raise
            _fsync_dir(view.parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# --- asking the hub ----------------------------------------------------------------------------


def resolve(source: ModelSource, root: Path, environ: dict[str, str], timeout_s: float) -> Plan:
    """The files `source` stands for, each with its size and digest (a network call for the hub)."""
    if source.kind == "url":
        size = _url_size(source, timeout_s)
        want = Want(name=source.name, url=source.url, size=size, algo="sha256", digest=source.sha256)
        return Plan(
            label=f"{source.name}@{source.sha256[:6]}",
            view=url_view(root, source),
            files=(want,),
            snapshot=False,
        )
    return _resolve_hf(source, root, environ, timeout_s)


def hub_endpoint(environ: dict[str, str]) -> str:
    from huggingface_hub import constants

    return (environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _resolve_hf(source: ModelSource, root: Path, environ: dict[str, str], timeout_s: float) -> Plan:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # exported lazily

    endpoint = hub_endpoint(environ)
    token: str | None = environ.get("HF_TOKEN") or None
    headers = tuple(build_hf_headers(token=token, library_name="llmgw").items())
    # The hub's host, never the whole endpoint: a mirror's URL may carry credentials.
    where = f"weights {source.name}: {source.repo}@{source.revision} on {_host(endpoint)}"
    try:
        if source.file:
            url = hf_hub_url(source.repo, source.file, revision=source.revision, endpoint=endpoint)
            meta = get_hf_file_metadata(url, token=token, timeout=timeout_s, endpoint=endpoint)
            if not meta.commit_hash:
                raise WeightsError(f"{where}: the hub named no commit for this revision (no X-Repo-Commit)")
            commit = check_commit(meta.commit_hash, where, "X-Repo-Commit")
            files: tuple[HubFile, ...] = (check_file(source.file, meta.size, meta.etag or "", "", where),)
        else:
            api = f"{endpoint}/api/models/{source.repo}/revision/{quote(source.revision, safe='')}"
            commit, files = parse_listing(_get_listing(api, dict(headers), timeout_s, where), where)
    except WeightsError:
        raise
    except Exception as exc:
        raise _hub_error(exc, source, where, timeout_s) from exc
    label = f"{source.name}@{commit[:6]}"
    wants = tuple(
        Want(
            name=f.name,
            url=hf_hub_url(source.repo, f.name, revision=commit, endpoint=endpoint),
            size=f.size,
            algo=f.algo,
            digest=f.digest,
            headers=headers,
        )
        for f in files
    )
    return Plan(
        label=label,
        view=hf_view(root, source, commit),
        files=wants,
        snapshot=not source.file,
        ref=None if source.pinned else hf_dir(root, source) / "refs" / source.revision,
        commit=commit,
    )


def _get_listing(url: str, headers: dict[str, str], timeout_s: float, where: str) -> bytes:
    """The repository's file listing (`model_info` with `blobs=true`, as huggingface_hub asks for
    it), read to `MAX_LISTING_BYTES` at most: `HfApi.model_info` would read any answer whole."""
    import httpx2
    from huggingface_hub import get_session, hf_raise_for_status

    with get_session().stream("GET", url, headers=headers, params={"blobs": True}, timeout=timeout_s) as r:
        limit = MAX_LISTING_BYTES if r.is_success else MAX_ERROR_BYTES
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > limit:
                break
        if not r.is_success:
            # The hub's errors (not found, gated, a revision it lacks) are read from its answer's
            # headers and the start of its body, as huggingface_hub reads them.
            cut = httpx2.Response(
                r.status_code, headers=r.headers, content=bytes(body[:limit]), request=r.request
            )
            hf_raise_for_status(cut)
            raise WeightsError(f"{where}: HTTP {r.status_code}")
    if len(body) > limit:
        raise WeightsError(
            f"{where}: the hub's file listing is over {size_words(MAX_LISTING_BYTES)}; "
            "nothing is staged from this answer",
            retryable=False,
        )
    return bytes(body)


@dataclass(frozen=True)
class HubFile:
    """One file as a hub's answer states it, checked: a plain name, a bounded size, a digest."""

    name: str
    size: int
    algo: Algo
    digest: str


# The fields of the hub's `model_info` the node reads; the rest of its answer is skipped.
class _Lfs(msgspec.Struct):
    sha256: str | None = None


class _Sibling(msgspec.Struct, rename={"blob_id": "blobId"}):
    rfilename: str | None = None
    size: int | None = None
    blob_id: str | None = None
    lfs: _Lfs | None = None


class _Listing(msgspec.Struct):
    sha: str | None = None
    siblings: list[_Sibling] | None = None


_listing_decoder = msgspec.json.Decoder(_Listing)


def parse_listing(body: bytes, where: str) -> tuple[str, tuple[HubFile, ...]]:
    """A repository's file listing (the hub's `model_info` JSON): its commit and its files, each
    checked (pure). Raises WeightsError, not retryable, naming the field and the value.

    Bounded before use: the body in bytes, the files in number and in their total size; every
    name a plain relative path, no two of them the same or one inside another (a file `a` and a
    file `a/b` cannot both be linked into one snapshot).
    """
    if len(body) > MAX_LISTING_BYTES:
        raise WeightsError(
            f"{where}: the hub's file listing is over {size_words(MAX_LISTING_BYTES)}; "
            "nothing is staged from this answer",
            retryable=False,
        )
    try:
        listing = _listing_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        # ValidationError is a DecodeError: it names the path (`$.siblings[2].size`).
        raise WeightsError(
            f"{where}: the hub's file listing cannot be read ({str(exc)[:200]}); "
            "nothing is staged from this answer",
            retryable=False,
        ) from exc
    if listing.sha is None:
        raise WeightsError(f"{where}: the hub named no commit for this revision (no sha in its file listing)")
    commit = check_commit(listing.sha, where, "sha")
    siblings = listing.siblings or []
    if not siblings:
        raise WeightsError(f"{where}: the repository has no files", retryable=False)
    if len(siblings) > MAX_LISTING_FILES:
        raise WeightsError(
            f"{where}: the hub's file listing names {len(siblings)} files, more than the {MAX_LISTING_FILES} "
            "a repository may have here; nothing is staged from this answer",
            retryable=False,
        )
    files: list[HubFile] = []
    for i, s in enumerate(siblings):
        lfs_sha = "" if s.lfs is None else s.lfs.sha256 or ""
        files.append(check_file(s.rfilename, s.size, s.blob_id or "", lfs_sha, where, f"siblings[{i}]"))
    total = sum(f.size for f in files)
    if total > MAX_MODEL_BYTES:
        raise WeightsError(
            f"{where}: the hub's file listing states {size_words(total)} in all, more than the "
            f"{size_words(MAX_MODEL_BYTES)} one repository may hold here; nothing is staged from this answer",
            retryable=False,
        )
    names = Counter(f.name for f in files)
    if len(names) < len(files):
        twice = min(n for n, count in names.items() if count > 1)
        raise _bad_answer(where, "file", twice, "is listed twice")
    for f in files:
        parts = f.name.split("/")
        for depth in range(1, len(parts)):
            if (folder := "/".join(parts[:depth])) in names:
                raise _bad_answer(where, "file", f.name, f"is inside {shown(folder)}, which is a file too")
    return commit, tuple(files)


def check_commit(value: object, where: str, field: str) -> str:
    """A commit id a hub stated (its `X-Repo-Commit`, a listing's `sha`): 40 hex digits, else
    WeightsError, not retryable. It names a directory of the store."""
    commit = value.lower() if isinstance(value, str) else value
    if not isinstance(commit, str) or not is_commit(commit):
        raise _bad_answer(where, field, value, "is not a commit id (40 hex digits)")
    return commit


def check_file(name: object, size: object, etag: str, lfs_sha: str, where: str, entry: str = "") -> HubFile:
    """One file as a hub stated it, checked: the name a plain relative path (the rule `hf://`
    names follow), the size a non-negative integer up to `MAX_FILE_BYTES`, the digest an LFS
    sha256 or a git blob id of the right length. Else WeightsError, not retryable.

    `entry` is where a listing states it (`siblings[3]`); "" for a file's own headers."""

    def field(key: str, header: str) -> str:
        return f"{entry}.{key}" if entry else header

    if not isinstance(name, str):
        raise _bad_answer(where, field("rfilename", "file name"), name, "is not a string")
    problem = path_problem(name)
    if problem is not None:
        raise _bad_answer(where, field("rfilename", "file name"), name, problem)
    if size is None or (not etag and not lfs_sha):
        raise WeightsError(
            f"{where}: the hub gave no size or checksum for {shown(name)}; "
            "it cannot be verified, so it is not staged",
            retryable=False,
        )
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        raise _bad_answer(
            where,
            field("size", "X-Linked-Size"),
            size,
            f"is not a size in bytes (0 to {size_words(MAX_FILE_BYTES)})",
        )
    algo, digest = _digest_of(etag, lfs_sha)
    if not digest:
        what = field("lfs.sha256", "ETag") if lfs_sha else field("blobId", "ETag")
        raise _bad_answer(
            where, what, lfs_sha or etag, "is not a sha256 or a git blob id (64 or 40 hex digits)"
        )
    return HubFile(name=name, size=size, algo=algo, digest=digest)


def _bad_answer(where: str, field: str, value: object, problem: str) -> WeightsError:
    return WeightsError(
        f"{where}: the hub's {field} {shown(value)} {problem}; nothing is staged from this answer",
        retryable=False,
    )


def _host(url: str) -> str:
    split = urlsplit(url)
    return f"{split.hostname}:{split.port}" if split.port else str(split.hostname)


def _digest_of(etag: str, lfs_sha: str) -> tuple[Algo, str]:
    """An LFS file's etag is its sha256; a small file's is its git blob id (sha1 of "blob N\\0" + bytes).
    ("sha256", "") for anything else: a stated digest of the wrong length or not hex is no digest."""
    if lfs_sha:
        lfs_sha = lfs_sha.strip().lower()
        return ("sha256", lfs_sha) if is_sha256(lfs_sha) else ("sha256", "")
    etag = etag.strip().removeprefix("W/").strip('"').lower()
    for algo, chars in _DIGEST_CHARS.items():
        if len(etag) == chars and set(etag) <= _HEX:
            return algo, etag
    return "sha256", ""


def _hub_error(exc: Exception, source: ModelSource, where: str, timeout_s: float) -> WeightsError:
    from huggingface_hub import errors

    token_hint = "set HF_TOKEN to a token that can read it"
    if isinstance(exc, errors.GatedRepoError):
        return WeightsError(
            f"{where}: {source.repo} is gated; accept its terms on the hub and {token_hint}", retryable=False
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return WeightsError(
            f"{where}: revision {source.revision} not found in {source.repo}; name a branch, tag or commit "
            "it has",
            retryable=False,
        )
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return WeightsError(f"{where}: file {source.file} not found in {source.repo}", retryable=False)
    if isinstance(exc, errors.RepositoryNotFoundError):
        status = _status_of(exc)
        return WeightsError(
            f"{where}: repository {source.repo} not found (HTTP {status}); if it is private, {token_hint}",
            retryable=False,
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = _status_of(exc)
        if status in (401, 403):
            return WeightsError(f"{where}: HTTP {status}, not allowed; {token_hint}", retryable=False)
        if status == 404:
            return WeightsError(f"{where}: HTTP 404, not found", retryable=False)
        return WeightsError(f"{where}: HTTP {status}: {_first_line(exc)}")
    # huggingface_hub speaks HTTP through httpx2 (a fork of httpx): its errors are its own classes.
    import httpx2

    if isinstance(exc, httpx.TimeoutException | httpx2.TimeoutException):
        return WeightsError(f"{where}: no answer within {timeout_s:g} s")
    if isinstance(exc, httpx.HTTPError | httpx2.HTTPError | OSError):
        return WeightsError(f"{where}: cannot reach the hub: {type(exc).__name__}: {exc}")
    return WeightsError(f"{where}: {type(exc).__name__}: {_first_line(exc)}")


def _status_of(exc: Exception) -> int:
    response = getattr(exc, "response", None)
    return int(getattr(response, "status_code", 0) or 0)


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _url_size(source: ModelSource, timeout_s: float) -> int:
    where = f"weights {source.name}@{source.sha256[:6]}: {source.url}"
    try:
        with _client(where, timeout_s) as client:
            r = client.head(source.url, headers={"Accept-Encoding": "identity"})
    except httpx.TimeoutException as exc:
        raise WeightsError(f"{where}: no answer within {timeout_s:g} s") from exc
    except httpx.TooManyRedirects as exc:
        raise _too_many_redirects(where) from exc
    except httpx.HTTPError as exc:
        raise WeightsError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise _http_status(where, r.status_code)
    stated = r.headers.get("Content-Length")
    if stated is None:
        raise WeightsError(f"{where}: the server states no Content-Length", retryable=False)
    size = parse_size(stated)
    if size is None:
        raise WeightsError(
            f"{where}: the server's Content-Length {shown(stated)} is not a size in bytes "
            f"(0 to {size_words(MAX_FILE_BYTES)}); nothing is staged from it",
            retryable=False,
        )
    return size


def parse_size(value: str) -> int | None:
    """A size a server states in a header: plain decimal digits up to `MAX_FILE_BYTES`, else None
    (Python's `int()` would take `-5`, `1_000` and other scripts' digits)."""
    value = value.strip()
    if not value or len(value) > 20 or not all(c in "0123456789" for c in value):
        return None
    size = int(value)
    return size if size <= MAX_FILE_BYTES else None


def _client(where: str, timeout_s: float, *, follow: bool = True) -> httpx.Client:
    """A client that follows at most `MAX_REDIRECTS` redirects, each to a URL checked as a
    `model:` URL is (http(s), a host, bounded, no control character), never from https to http;
    with `follow` False (a peer's URL), none: a peer cannot send a node elsewhere."""
    seen: list[str] = []

    def check(request: httpx.Request) -> None:
        url = str(request.url)
        problem = url_problem(url)
        if (
            problem is None
            and seen
            and urlsplit(seen[-1]).scheme == "https"
            and request.url.scheme != "https"
        ):
            problem = "leaves https for http"
        if problem is not None:
            hop = f"a redirect to {shown(url)}" if seen else shown(url)
            raise WeightsError(f"{where}: {hop} {problem}; not followed", retryable=False)
        seen.append(url)

    return httpx.Client(
        timeout=timeout_s,
        follow_redirects=follow,
        max_redirects=MAX_REDIRECTS,
        event_hooks={"request": [check]},
    )


def _too_many_redirects(where: str) -> WeightsError:
    return WeightsError(
        f"{where}: more than {MAX_REDIRECTS} redirects; not followed further", retryable=False
    )


def _http_status(where: str, status: int) -> WeightsError:
    if status in (401, 403):
        return WeightsError(f"{where}: HTTP {status}, not allowed", retryable=False)
    if status in (404, 410):
        return WeightsError(f"{where}: HTTP {status}, not found", retryable=False)
    return WeightsError(f"{where}: HTTP {status}")


# --- fetching the bytes ------------------------------------------------------------------------


def _hasher(want: Want) -> Any:
    if want.algo == "gitsha1":
        h = hashlib.sha1(usedforsecurity=False)
        h.update(f"blob {want.size}\0".encode())
        return h
    return hashlib.sha256()


def fetch(
    want: Want,
    blobs: Path,
    label: str,
    progress: Progress,
    stop: threading.Event,
    timeout_s: float,
    peer: str = "",
) -> Path:
    """`want` into `blobs/<blob>`, resuming its `.partial`, hashed as it arrives; renamed only when whole."""
    final = blobs / want.blob
    partial = blobs / f"{want.blob}.partial"
    base = progress.done
    where = f"weights {label}: {want.name}"
    hasher = _hasher(want)
    have = _size(partial)
    if have > want.size:
        partial.unlink()
        have = 0
    if have:
        with partial.open("rb") as f:
            while block := f.read(CHUNK):
                hasher.update(block)
    progress.done = base + have
    headers = dict(want.headers)
    headers["Accept-Encoding"] = "identity"
    if have:
        headers["Range"] = f"bytes={have}-"
    host = urlsplit(want.url).netloc
    if peer:
        host = f"peer {peer} ({host})"
    try:
        with (
            _client(f"{where} from {host}" if peer else where, timeout_s, follow=not peer) as client,
            client.stream("GET", want.url, headers=headers) as r,
        ):
            if (r.status_code == 416 and have == want.size) or (r.status_code == 206 and have):
                pass
            elif r.status_code == 200:
                if have:  # the server ignored the Range: start over
                    hasher, have = _hasher(want), 0
                    partial.unlink(missing_ok=True)
            else:
                raise _http_status(f"{where} from {host}" if peer else where, r.status_code)
            window_at, window_have = time.monotonic(), have
            with partial.open("ab") as out:
                # As the bytes arrive, not in fixed chunks: a chunk still buffered when the
                # connection drops would be lost, and the resume would start before it.
                for chunk in r.iter_bytes():
                    if stop.is_set():
                        raise WeightsError(f"{where}: stopped", retryable=True)
                    if peer and (at := time.monotonic()) - window_at >= timeout_s:
                        rate = (have - window_have) / (at - window_at)
                        if rate < PEER_MIN_BYTES_PER_S:
                            raise WeightsError(
                                f"{where}: {host} sent {size_words(int(rate))}/s over "
                                f"{at - window_at:.0f} s, under the {size_words(PEER_MIN_BYTES_PER_S)}/s "
                                "a peer must send; "
                                "the next attempt resumes from there"
                            )
                        window_at, window_have = at, have
                    if have + len(chunk) > want.size:
                        out.close()
                        partial.unlink(missing_ok=True)
                        raise WeightsError(
                            f"{where}: {host} sent more than the {want.size} bytes the hub states; discarded"
                        )
                    out.write(chunk)
                    hasher.update(chunk)
                    have += len(chunk)
                    progress.done = base + have
                out.flush()
                os.fsync(out.fileno())
    except httpx.TooManyRedirects as exc:
        raise _too_many_redirects(f"{where} from {host}" if peer else where) from exc
    except httpx.TimeoutException as exc:
        raise WeightsError(
            f"{where}: no data from {host} for {timeout_s:g} s at {amount(have, want.size)}; "
            "the next attempt resumes from there"
        ) from exc
    except httpx.HTTPError as exc:
        raise WeightsError(
            f"{where}: the download broke off at {amount(have, want.size)} ({type(exc).__name__}: {exc}); "
            "the next attempt resumes from there"
        ) from exc
    except OSError as exc:
        raise WeightsError(f"{where}: cannot write {partial}: {exc.strerror or exc}") from exc
    if have < want.size:
        raise WeightsError(
            f"{where}: the download ended at {amount(have, want.size)}; the next attempt resumes from there"
        )
    digest = hasher.hexdigest()
    if digest != want.digest:
        partial.unlink(missing_ok=True)
        kind = "sha256" if want.algo == "sha256" else "git blob id"
        raise WeightsError(
            f"{where}: {kind} mismatch: expected {want.digest}, got {digest}; the download is discarded"
        )
    os.replace(partial, final)
    _fsync_dir(blobs)
    return final


# --- what the store holds, and what may go -------------------------------------------------------


@dataclass(frozen=True)
class Staged:
    """One staged view: where, as `weights_key` names it, and when a shard last asked for it."""

    path: Path
    key: str
    used_at: float
    repo: str = ""
    commit: str = ""
    file: str = ""  # "" for a snapshot
    sha256: str = ""


@dataclass(frozen=True)
class Eviction:
    key: str
    path: Path
    freed: int
    used_at: float
    words: str


def staged_views(root: Path) -> list[Staged]:
    """Every view the store holds (directory names only, no model read)."""
    found: list[Staged] = []
    hf = root / "hf"
    for commit_dir in sorted(hf.glob("*/*/*")) if hf.is_dir() else ():
        if commit_dir.name in ("refs",) or commit_dir.name.startswith(".") or not commit_dir.is_dir():
            continue
        repo, commit = "/".join(commit_dir.parent.relative_to(hf).parts), commit_dir.name
        snapshot = commit_dir / "snapshot"
        if snapshot.is_dir():
            found.append(Staged(snapshot, f"hf://{repo}@{commit}", _used_at(snapshot), repo, commit))
        files = commit_dir / "files"
        for f in sorted(files.rglob("*")) if files.is_dir() else ():
            if f.is_file() and not f.name.startswith("."):
                name = f.relative_to(files).as_posix()
                found.append(Staged(f, f"hf://{repo}/{name}@{commit}", _used_at(f), repo, commit, name))
    url = root / "url"
    for f in sorted(url.glob("*/*")) if url.is_dir() else ():
        if f.is_file() and not f.name.startswith("."):
            found.append(Staged(f, f"sha256:{f.parent.name}", _used_at(f), sha256=f.parent.name))
    return found


def evictable(views: list[Staged], keep: list[ModelSource]) -> list[Staged]:
    """The views no source in `keep` may read, least recently used first (pure).

    A source at a branch keeps every commit of its repository's file: the commit a running
    engine read may not be the one the branch names now (an engine adopted after a restart,
    a branch that moved), and an engine's model must never go from under it.
    """
    return sorted((v for v in views if not any(_reads(s, v) for s in keep)), key=lambda v: (v.used_at, v.key))


def _reads(source: ModelSource, view: Staged) -> bool:
    if source.kind == "url":
        return view.sha256 == source.sha256
    if source.kind != "hf" or view.repo != source.repo or view.file != source.file:
        return False
    return not source.pinned or view.commit == source.revision


def _marker(view: Path) -> Path:
    """When a shard last asked for `view`: the mtime of a dot-file beside it."""
    return view.parent / f".{view.name}.used"


def _record_shape(view: Path) -> None:
    """The model's shape from its headers, kept beside the view once (the probe reports it and
    placement fits the model with it). Weights whose shape cannot be read (a file that is not
    a model, an architecture without the counts) are staged all the same, only not fitted."""
    target = shape_file(view)
    if target.exists() or not (view.is_dir() or view.suffix in (".gguf", ".safetensors")):
        return
    try:
        shape = read_shape(view)
    except FitError as exc:
        log.info("weights %s: no memory estimate for placement: %s", view, exc)
        return
    except Exception:  # a reader's surprise on odd bytes must not fail a verified staging
        log.exception("weights %s: no memory estimate for placement: its header could not be read", view)
        return
    try:
        _write_atomic(target, msgspec.json.encode(shape))
    except OSError as exc:
        log.warning("cannot record the shape of %s: %s", view, exc.strerror or exc)


def _touch(view: Path) -> None:
    marker = _marker(view)
    try:
        marker.touch()
        os.utime(marker)
    except OSError as exc:
        log.warning("cannot mark %s used: %s", view, exc.strerror or exc)


def _used_at(view: Path) -> float:
    for p in (_marker(view), view):
        try:
            return p.lstat().st_mtime
        except OSError:
            continue
    return 0.0


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file()]
    return [path] if path.is_file() else []


def _prune_empty(directory: Path, root: Path) -> None:
    """Remove directories left empty up to the store's `hf/` or `url/` (refs stay)."""
    while directory != root and directory.parent != root and directory.is_relative_to(root):
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


# --- files ---------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tree_size(root: Path) -> int:
    """Bytes the store holds: its blobs and partial downloads (views are links to blobs)."""
    blobs = root / "blobs"
    try:
        return sum(p.stat().st_size for p in blobs.iterdir())
    except OSError:
        return 0


def _inside(root: Path, path: Path, label: str) -> Path:
    """`path`, once proven inside `root` with every link on the way resolved; else the staging
    fails, not retryable. A name that passed every check can still lead out through a link
    planted under the store (`hf/org` linked to `/`): the resolved path is what is judged."""
    try:
        real_root, real = root.resolve(), path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links
        raise WeightsError(
            f"weights {label}: cannot resolve {shown(str(path))}: {exc}", retryable=False
        ) from exc
    if not real.is_relative_to(real_root):
        raise WeightsError(
            f"weights {label}: {shown(str(path))} leads outside {root} (to {shown(str(real))}); "
            "nothing is written there",
            retryable=False,
        )
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
