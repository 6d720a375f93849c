"""Where a profile's weights come from: `model:` parsed into a `ModelSource`, or the error that says why not.

    hf://<org>/<repo>[/<file>][@<revision>]   a Hugging Face repository: one file, or the whole snapshot
    https://host/path/x.gguf                  one file at a URL; `model_sha256:` is required
    file:///models/x.gguf                     pre-staged on the node; checked to exist first

A `model:` without `://` is a name (what the engine serves it as), as it always was;
the weights are then at `model_path`. Pure: nothing here touches the network or a disk.
"""

from __future__ import annotations

import functools
import re
from typing import Literal
from urllib.parse import unquote, urlsplit

from msgspec import Struct

SourceKind = Literal["hf", "url", "file"]

SCHEMES = ("hf://", "https://", "http://", "file://")
# What the hub accepts in an org or repository name.
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class SourceError(ValueError):
    """A `model:` (or `model_sha256:`) that cannot be staged; the message names the field."""


class ModelSource(Struct, frozen=True, kw_only=True):
    kind: SourceKind
    # hf: the repository ("org/repo"), the file in it ("" for the whole snapshot), the revision asked for.
    repo: str = ""
    file: str = ""
    revision: str = "main"
    # url: where the bytes are, and the sha256 they must have.
    url: str = ""
    sha256: str = ""
    # file: the path on the node.
    path: str = ""

    @property
    def pinned(self) -> bool:
        """A commit id names the same bytes forever: no need to ask the hub again once staged."""
        return self.kind != "hf" or bool(_COMMIT.match(self.revision))

    @property
    def name(self) -> str:
        """The short name the node's progress words use: the repository's or the file's."""
        if self.kind == "hf":
            return self.repo.rsplit("/", 1)[-1]
        target = self.path if self.kind == "file" else urlsplit(self.url).path
        return target.rstrip("/").rsplit("/", 1)[-1] or target

    def __str__(self) -> str:
        if self.kind == "hf":
            tail = f"/{self.file}" if self.file else ""
            return f"hf://{self.repo}{tail}@{self.revision}"
        return self.url if self.kind == "url" else f"file://{self.path}"


def is_source(model: str) -> bool:
    """Whether `model:` names where weights come from (else it is the served name)."""
    return "://" in model


def parse_source(model: str, sha256: str = "", *, profile: str = "") -> ModelSource | None:
    """`model:` as a source; None when it is a plain name. Raises SourceError naming the field."""
    where = f"profile {profile}: " if profile else ""
    model = model.strip()
    if not is_source(model):
        if sha256:
            raise SourceError(f"{where}model_sha256 is set but model {model!r} is not an https:// URL")
        return None
    scheme = model.split("://", 1)[0].lower() + "://"
    if scheme not in SCHEMES:
        raise SourceError(
            f"{where}model {model!r} has an unknown scheme {scheme!r}; "
            "use hf://<org>/<repo>[/<file>][@<revision>], https://… with model_sha256, or file:///path"
        )
    if scheme == "hf://":
        if sha256:
            raise SourceError(
                f"{where}model_sha256 is for https:// models; the hub states the sha256 of {model}"
            )
        return _parse_hf(model, where)
    if scheme == "file://":
        if sha256:
            raise SourceError(f"{where}model_sha256 is for https:// models, not file:// ones")
        return _parse_file(model, where)
    return _parse_url(model, sha256, where)


def _parse_hf(model: str, where: str) -> ModelSource:
    body = model[len("hf://") :]
    revision = "main"
    if "@" in body:
        body, revision = body.rsplit("@", 1)
        if not revision:
            raise SourceError(f"{where}model {model!r}: the revision after '@' is empty")
    parts = body.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise SourceError(f"{where}model {model!r} must name a repository: hf://<org>/<repo>[/<file>]")
    org, repo = parts[0], parts[1]
    for part in (org, repo):
        if not _REPO_PART.match(part) or ".." in part:
            raise SourceError(f"{where}model {model!r}: {part!r} is not a valid hub org or repository name")
    file = "/".join(parts[2:])
    if file and (any(p in ("", ".", "..") for p in parts[2:]) or file.startswith("/")):
        raise SourceError(
            f"{where}model {model!r}: the file {file!r} is not a plain path inside the repository"
        )
    if not revision.strip() or any(c in revision for c in " \t\n"):
        raise SourceError(f"{where}model {model!r}: the revision {revision!r} is not valid")
    return ModelSource(kind="hf", repo=f"{org}/{repo}", file=file, revision=revision)


def _parse_file(model: str, where: str) -> ModelSource:
    split = urlsplit(model)
    if split.netloc not in ("", "localhost"):
        raise SourceError(
            f"{where}model {model!r}: a file:// model is on the node itself; "
            f"write file:///path (three slashes), not a host {split.netloc!r}"
        )
    path = unquote(split.path)
    if not path.startswith("/") or path == "/":
        raise SourceError(
            f"{where}model {model!r}: a file:// model needs an absolute path (file:///models/x.gguf)"
        )
    return ModelSource(kind="file", path=path)


def _parse_url(model: str, sha256: str, where: str) -> ModelSource:
    split = urlsplit(model)
    if not split.hostname:
        raise SourceError(f"{where}model {model!r} has no host")
    name = split.path.rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise SourceError(f"{where}model {model!r} must name a file, not a directory")
    digest = sha256.strip().lower()
    if not digest:
        raise SourceError(
            f"{where}model {model!r} needs model_sha256 (the file's sha256, 64 hex digits): "
            "a URL's bytes are verified before an engine reads them"
        )
    if not _SHA256.match(digest):
        raise SourceError(f"{where}model_sha256 {sha256!r} is not 64 hex digits")
    return ModelSource(kind="url", url=model, sha256=digest)


@functools.lru_cache(maxsize=4096)
def weights_key(model: str, sha256: str, model_path: str) -> str:
    """How a node names these weights when it reports holding them (`llmgw_core.staged.held`).

    A hub source by itself (`hf://org/repo/file@main`), a URL by its content (`sha256:<hex>`),
    a file or a plain `model_path` by its path, as the node's `model_paths` report it.
    """
    try:
        source = parse_source(model, sha256)
    except SourceError:
        return model_path
    if source is None:
        return model_path
    if source.kind == "hf":
        return str(source)
    if source.kind == "url":
        return f"sha256:{source.sha256}"
    return source.path


@functools.lru_cache(maxsize=4096)
def staged_key(model: str, sha256: str) -> str:
    """`weights_key` of weights the node stages itself (a hub or URL source); "" for a file it
    must already hold, or a path its engine resolves: those are never on their way to a node."""
    try:
        source = parse_source(model, sha256)
    except SourceError:
        return ""
    if source is None or source.kind == "file":
        return ""
    return weights_key(model, sha256, "")


@functools.lru_cache(maxsize=4096)
def node_file(model: str, sha256: str, model_path: str) -> str:
    """The file (or directory) on the node that a profile's engine reads, where the node must
    already hold it: a `file://` source's path, or an absolute `model_path` when `model` names
    no source; else "" (a source the node stages, or a relative `model_path`, which vLLM and
    SGLang may read as a hub repository id and resolve themselves)."""
    try:
        source = parse_source(model, sha256)
    except SourceError:
        return ""
    if source is not None:
        return source.path if source.kind == "file" else ""
    return model_path if model_path.startswith("/") else ""
