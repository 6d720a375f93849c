"""A Hugging Face-shaped hub on loopback: the endpoints huggingface_hub calls to stage a model.

    GET  /api/models/<org>/<repo>[/revision/<rev>]   model info; `?blobs=true` adds sizes, LFS sha256s
    HEAD /<org>/<repo>/resolve/<rev>/<file>          X-Repo-Commit, ETag (an LFS file's sha256, else its git
                                                     blob id), X-Linked-Size, Content-Length
    GET  /<org>/<repo>/resolve/<rev>/<file>          the bytes, with Range
    GET  /files/<name> (and HEAD)                    a plain file, for https:// sources

Errors as the hub sends them (404 with X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound;
401 for a private repository without the token). Faults, each set by a test: `cut_once[file] = n`
sends n bytes of the file's first GET and drops the connection; `wrong_sha[file]` states a sha256
that the bytes do not have; `hang` holds every download open without a byte, `hang_metadata`
every metadata request without an answer. `served[file]` counts
the bytes that went out, `gets` the (file, Range header) of every download.

Hostile answers, each set by a test: `headers` replace a file's own on every resolve (a commit
`../../x`, an ETag that is no digest, a size of -5), `plain_headers` a plain file's (a
Content-Length); `sibling_patch[file]` is merged into one file's entry in a repository's
listing (`rfilename`, `size`, `lfs`), and `extra_siblings` appended to the listing;
`listing_padding` bytes of JSON whitespace go before the listing, streamed (an answer too big
to read whole); `redirects[path]` answers a request for that path with a 302 to the location
given (`redirected` counts them). A repository's `commit`, and its files' names, may be anything.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# Files at least this big are LFS files (the hub's etag is their sha256), as on the real hub.
LFS_FROM = 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    revisions: tuple[str, ...] = ("main",)
    token: str = ""  # private: only this bearer token reads it


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    plain: dict[str, bytes] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)
    wrong_sha: set[str] = field(default_factory=set)
    hang: bool = False
    hang_metadata: bool = False
    served: Counter[str] = field(default_factory=Counter)
    gets: list[tuple[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    plain_headers: dict[str, str] = field(default_factory=dict)
    sibling_patch: dict[str, dict[str, object]] = field(default_factory=dict)
    extra_siblings: list[object] = field(default_factory=list)
    listing_padding: int = 0
    redirects: dict[str, str] = field(default_factory=dict)
    redirected: list[str] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, repo: str, files: dict[str, bytes], token: str = "") -> Repo:
        seed = repo.encode() + b"".join(hashlib.sha256(files[n]).digest() for n in sorted(files))
        commit = hashlib.sha1(seed, usedforsecurity=False).hexdigest()
        r = Repo(files=dict(files), commit=commit, revisions=("main", commit), token=token)
        self.repos[repo] = r
        return r


class Hub:
    def __init__(self, state: HubState, url: str) -> None:
        self.state = state
        self.url = url

    def add(self, repo: str, files: dict[str, bytes], token: str = "") -> Repo:
        return self.state.add(repo, files, token)

    def add_plain(self, name: str, data: bytes) -> str:
        self.state.plain[name] = data
        return f"{self.url}/files/{name}"


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

        # --- routing ---

        def _route(self, head: bool) -> None:
            if state.hang_metadata and (head or self.path.startswith("/api/")):
                state.stopping.wait(120)
                self.close_connection = True
                return
            split = urlsplit(self.path)
            if split.path in state.redirects:
                with state.lock:
                    state.redirected.append(split.path)
                self.send_response(302)
                self.send_header("Location", state.redirects[split.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            parts = [unquote(p) for p in split.path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = f"{parts[2]}/{parts[3]}"
                rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
                return self._info(repo, rev, "blobs=true" in split.query)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                return self._resolve(repo, rev, name, head)
            if parts[0] == "files" and len(parts) == 2 and parts[1] in state.plain:
                data = state.plain[parts[1]]
                return self._send_file(parts[1], data, head, dict(state.plain_headers))
            self._error(404, "")

        def _repo(self, name: str, rev: str) -> Repo | None:
            repo = state.repos.get(name)
            auth = self.headers.get("Authorization", "")
            if repo is None or (repo.token and auth != f"Bearer {repo.token}"):
                self._error(401 if repo is not None else 404, "RepoNotFound")
                return None
            if rev not in repo.revisions:
                self._error(404, "RevisionNotFound")
                return None
            return repo

        def _info(self, name: str, rev: str, blobs: bool) -> None:
            repo = self._repo(name, rev)
            if repo is None:
                return
            siblings: list[dict[str, object]] = []
            for fname, data in sorted(repo.files.items()):
                entry: dict[str, object] = {"rfilename": fname}
                if blobs:
                    entry["size"] = len(data)
                    entry["blobId"] = git_blob_id(data)
                    if len(data) >= LFS_FROM:
                        entry["lfs"] = {
                            "size": len(data),
                            "sha256": self._sha(fname, data),
                            "pointerSize": 134,
                        }
                entry.update(state.sibling_patch.get(fname, {}))
                siblings.append(entry)
            listing = {
                "id": name,
                "modelId": name,
                "sha": repo.commit,
                "siblings": siblings + state.extra_siblings,
            }
            body = json.dumps(listing).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(state.listing_padding + len(body)))
            self.end_headers()
            try:
                left = state.listing_padding
                while left > 0:
                    chunk = min(left, 1 << 20)
                    self.wfile.write(b" " * chunk)
                    left -= chunk
                self.wfile.write(body)
            except OSError:  # a reader that stopped at its limit and hung up
                self.close_connection = True

        def _sha(self, fname: str, data: bytes) -> str:
            if fname in state.wrong_sha:
                return hashlib.sha256(b"not these bytes").hexdigest()
            return hashlib.sha256(data).hexdigest()

        def _resolve(self, name: str, rev: str, fname: str, head: bool) -> None:
            repo = self._repo(name, rev)
            if repo is None:
                return
            data = repo.files.get(fname)
            if data is None:
                self._error(404, "EntryNotFound")
                return
            etag = self._sha(fname, data) if len(data) >= LFS_FROM else git_blob_id(data)
            extra = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "X-Linked-Size": str(len(data))}
            extra.update(state.headers)
            self._send_file(fname, data, head, extra)

        # --- bytes ---

        def _send_file(self, fname: str, data: bytes, head: bool, extra: dict[str, str]) -> None:
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[len("bytes=") : -1])
            if start >= len(data) and rng:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            length = extra.pop("Content-Length", str(len(data) - start))
            self.send_response(206 if rng else 200)
            for k, v in extra.items():
                self.send_header(k, v)
            self.send_header("Accept-Ranges", "bytes")
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", length)
            self.end_headers()
            if head:
                return
            with state.lock:
                state.gets.append((fname, rng))
                cut = state.cut_once.pop(fname, None)
            if state.hang:
                state.stopping.wait(120)
                self.close_connection = True
                return
            body = data[start:] if cut is None else data[start : start + cut]
            self.wfile.write(body)
            self.wfile.flush()
            with state.lock:
                state.served[fname] += len(body)
            if cut is not None:
                # The connection drops mid-file, as a proxy or a flaky link would drop it.
                self.close_connection = True
                self.connection.shutdown(2)

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


@contextmanager
def hf_hub(host: str = "127.0.0.1") -> Iterator[Hub]:
    """The hub on `host` (port 0), stopped on exit."""
    state = HubState()
    server = ThreadingHTTPServer((host, 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="hf-hub", daemon=True)
    thread.start()
    try:
        yield Hub(state, f"http://{host}:{server.server_address[1]}")
    finally:
        state.stopping.set()
        server.shutdown()
        server.server_close()
