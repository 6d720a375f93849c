"""Where a profile's weights come from: `model:` parsed into a `ModelSource`, or the error that says why not.

    hf://<org>/<repo>[/<file>][@<revision>]   a Hugging Face repository: one file, or the whole snapshot
    https://host/path/x.gguf                  one file at a URL; `model_sha256:` is required
    file:///models/x.gguf                     pre-staged on the node; checked to exist first

A `model:` without `://` is a name (what the engine serves it as), as it always was;
the weights are then at `model_path`. Pure: nothing here touches the network or a disk.

`parse_model` reads `model:` once, into a `ModelRef` (the name, or the source, or why neither)
that the profile keeps (`Profile.model_ref`); nothing else tests the text for a scheme.

Every name that becomes part of a path on the node passes `path_problem` first: a file in a
repository and a revision as a profile names them here, and the same names, commits and digests
as a hub or a mirror answers them (`llmgw_launcher.weights`). A name with a `..` part, an
absolute one, or one with a NUL would put files outside the node's models directory.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from msgspec import Struct

SourceKind = Literal["hf", "url", "file"]

SCHEMES = ("hf://", "https://", "http://", "file://")
# What the hub accepts in an org or repository name (96 characters at most, as on the hub).
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A `model:` longer than this is refused before it is parsed.
MAX_SOURCE_CHARS = 4096
# A file in a repository, or a revision: at most this many UTF-8 bytes, parts, bytes a part (a
# Linux file name's limit), so that the path it becomes fits PATH_MAX under any models directory.
MAX_NAME_BYTES = 1024
MAX_NAME_PARTS = 32
MAX_PART_BYTES = 255
# A value quoted in an error is cut to this many characters: a hostile answer can be long.
SHOWN_CHARS = 80


class SourceError(ValueError):
    """A `model:` (or `model_sha256:`) that cannot be staged, as fields: what is wrong (`words`,
    naming the field) and the profile that says it ("" where none was named). Its text is
    `profile <name>: <words>`, or the words alone."""

    def __init__(self, words: str, *, profile: str = "") -> None:
        super().__init__(words)
        self.words = words
        self.profile = profile

    def __str__(self) -> str:
        return f"profile {self.profile}: {self.words}" if self.profile else self.words


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
        return self.kind != "hf" or is_commit(self.revision)

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


def shown(value: object) -> str:
    """`value` as an error quotes it: its repr, cut to `SHOWN_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}…"


def _control(value: str) -> bool:
    """A NUL or other control character, or a lone surrogate (no file name can hold one)."""
    return any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in value)


def path_problem(name: str) -> str | None:
    """Why `name` (a file in a repository, a revision) cannot become a path under a directory of
    the node, or None when it can: a relative path of plain parts, bounded in length and depth.

    The words complete a sentence that quotes the name: `'../x' has a '..' part`.
    """
    if not name:
        return "is empty"
    if _control(name):
        return "has a NUL, a control character or a lone surrogate"
    if "\\" in name:
        return "has a backslash"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} bytes"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if len(parts) > MAX_NAME_PARTS:
        return f"has more than {MAX_NAME_PARTS} parts"
    if ".." in parts:
        return "has a '..' part"
    if any(p in ("", ".") for p in parts):
        return "has an empty or '.' part"
    if any(len(p.encode()) > MAX_PART_BYTES for p in parts):
        return f"has a part longer than {MAX_PART_BYTES} bytes"
    return None


def revision_problem(revision: str) -> str | None:
    """`path_problem` for a branch, tag or commit (it names `refs/<revision>` on the node), and no
    whitespace: git allows none in a ref."""
    problem = path_problem(revision)
    if problem is None and any(c.isspace() for c in revision):
        return "has whitespace"
    return problem


def is_commit(value: str) -> bool:
    """A commit id: 40 lowercase hex digits, nothing around them."""
    return bool(_COMMIT.fullmatch(value))


def is_sha256(value: str) -> bool:
    """A sha256: 64 lowercase hex digits, nothing around them."""
    return bool(_SHA256.fullmatch(value))


def url_problem(url: str) -> str | None:
    """Why bytes cannot be fetched from `url` (a `model:` URL, or where a server redirected the
    node to), or None: http(s), a host, no whitespace or control character, bounded length."""
    if len(url) > MAX_SOURCE_CHARS:
        return f"is longer than {MAX_SOURCE_CHARS} characters"
    if _control(url) or any(c.isspace() for c in url):
        return "has whitespace, a control character or a lone surrogate"
    try:
        split = urlsplit(url)
        host = split.hostname
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if split.scheme.lower() not in ("http", "https"):
        return "is not an http:// or https:// URL"
    if not host:
        return "has no host"
    return None


def is_source(model: str) -> bool:
    """Whether `model:` names where weights come from (else it is the served name)."""
    return "://" in model


def parse_source(model: str, sha256: str = "", *, profile: str = "") -> ModelSource | None:
    """`model:` as a source; None when it is a plain name. Raises SourceError naming the field
    (and `profile`, where given)."""
    try:
        return _parse(model, sha256)
    except SourceError as exc:
        if not profile:
            raise
        raise SourceError(exc.words, profile=profile) from exc.__cause__


def _parse(model: str, sha256: str) -> ModelSource | None:
    model = model.strip()
    if not is_source(model):
        if sha256:
            raise SourceError(f"model_sha256 is set but model {shown(model)} is not an https:// URL")
        return None
    # Bounded before it is parsed: a source names paths and URLs on every node it goes to.
    if len(model) > MAX_SOURCE_CHARS:
        raise SourceError(f"model {shown(model)} is longer than {MAX_SOURCE_CHARS} characters")
    if _control(model):
        raise SourceError(f"model {shown(model)} has a NUL, a control character or a lone surrogate")
    scheme = model.split("://", 1)[0].lower() + "://"
    if scheme not in SCHEMES:
        raise SourceError(
            f"model {model!r} has an unknown scheme {scheme!r}; "
            "use hf://<org>/<repo>[/<file>][@<revision>], https://… with model_sha256, or file:///path"
        )
    if scheme == "hf://":
        if sha256:
            raise SourceError(f"model_sha256 is for https:// models; the hub states the sha256 of {model}")
        return _parse_hf(model)
    if scheme == "file://":
        if sha256:
            raise SourceError("model_sha256 is for https:// models, not file:// ones")
        return _parse_file(model)
    return _parse_url(model, sha256)


def _parse_hf(model: str) -> ModelSource:
    body = model[len("hf://") :]
    revision = "main"
    if "@" in body:
        body, revision = body.rsplit("@", 1)
        if not revision:
            raise SourceError(f"model {model!r}: the revision after '@' is empty")
    parts = body.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise SourceError(f"model {model!r} must name a repository: hf://<org>/<repo>[/<file>]")
    org, repo = parts[0], parts[1]
    for part in (org, repo):
        if not _REPO_PART.fullmatch(part) or ".." in part:
            raise SourceError(f"model {model!r}: {part!r} is not a valid hub org or repository name")
    file = "/".join(parts[2:])
    problem = path_problem(file) if file else None
    if problem is not None:
        raise SourceError(
            f"model {model!r}: the file {shown(file)} is not a plain path inside the repository: it {problem}"
        )
    problem = revision_problem(revision)
    if problem is not None:
        raise SourceError(f"model {model!r}: the revision {shown(revision)} is not valid: it {problem}")
    return ModelSource(kind="hf", repo=f"{org}/{repo}", file=file, revision=revision)


def _parse_file(model: str) -> ModelSource:
    try:
        split = urlsplit(model)
    except ValueError as exc:
        raise SourceError(f"model {model!r} is not a URL: {exc}") from exc
    if split.netloc not in ("", "localhost"):
        raise SourceError(
            f"model {model!r}: a file:// model is on the node itself; "
            f"write file:///path (three slashes), not a host {split.netloc!r}"
        )
    path = unquote(split.path)
    if not path.startswith("/") or path == "/":
        raise SourceError(f"model {model!r}: a file:// model needs an absolute path (file:///models/x.gguf)")
    return ModelSource(kind="file", path=path)


def _parse_url(model: str, sha256: str) -> ModelSource:
    problem = url_problem(model)
    if problem is not None:
        raise SourceError(f"model {model!r} {problem}")
    name = urlsplit(model).path.rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise SourceError(f"model {model!r} must name a file, not a directory")
    # The name is the staged file's (`url/<sha256>/<name>`): one plain part, never `..`.
    problem = path_problem(name)
    if problem is not None:
        raise SourceError(f"model {model!r}: the file name {shown(name)} {problem}")
    digest = sha256.strip().lower()
    if not digest:
        raise SourceError(
            f"model {model!r} needs model_sha256 (the file's sha256, 64 hex digits): "
            "a URL's bytes are verified before an engine reads them"
        )
    if not is_sha256(digest):
        raise SourceError(f"model_sha256 {sha256!r} is not 64 hex digits")
    return ModelSource(kind="url", url=model, sha256=digest)


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A profile's `model:` parsed once: the served name it gives, or the source it names, or
    why it names neither (a source that cannot be staged, a `model_sha256` beside a name).

    The operator writes one `model:` key; its two meanings are two fields here, and every
    reader takes the one it needs (`Profile.source`, `Profile.served_name`), never testing
    the text for a scheme again."""

    # `model:` as the served name; "" where it names a source (a URL is no name to ask for).
    name: str = ""
    source: ModelSource | None = None
    error: SourceError | None = None
    # How a node names the source's weights when it reports holding them (`weights_key`).
    key: str = ""

    def weights_key(self, model_path: str) -> str:
        """How a node names these weights when it reports holding them (`llmgw_core.staged.held`).

        A hub source by itself (`hf://org/repo/file@main`), a URL by its content (`sha256:<hex>`),
        a file or a plain `model_path` by its path, as the node's `model_paths` report it.
        """
        return self.key if self.source is not None else model_path

    def staged_key(self) -> str:
        """`weights_key` of weights the node stages itself (a hub or URL source); "" for a file it
        must already hold, or a path its engine resolves: those are never on their way to a node."""
        return self.key if self.source is not None and self.source.kind != "file" else ""

    def node_file(self, model_path: str) -> str:
        """The file (or directory) on the node that a profile's engine reads, where the node must
        already hold it: a `file://` source's path, or an absolute `model_path` when `model` names
        no source; else "" (a source the node stages, or a relative `model_path`, which vLLM and
        SGLang may read as a hub repository id and resolve themselves)."""
        if self.error is not None:
            return ""
        if self.source is not None:
            return self.source.path if self.source.kind == "file" else ""
        return model_path if model_path.startswith("/") else ""


def _key(source: ModelSource) -> str:
    if source.kind == "hf":
        return str(source)
    if source.kind == "url":
        return f"sha256:{source.sha256}"
    return source.path


# Parsed once per text, and the value kept: a profile is decoded anew from every shard spec,
# and reading its weights key is on placement's hottest path; a fleet names a handful of models.
@functools.lru_cache(maxsize=4096)
def parse_model(model: str, sha256: str = "", profile: str = "") -> ModelRef:
    """`model:` (with `model_sha256:`) as a `ModelRef`. Total: a source that cannot be staged is
    kept as its `SourceError` (naming `profile`), for whoever acts on the source to say."""
    name = "" if is_source(model) else model
    try:
        source = parse_source(model, sha256, profile=profile)
    except SourceError as exc:
        return ModelRef(name=name, error=exc.with_traceback(None))
    return ModelRef(name=name, source=source, key=_key(source) if source is not None else "")


# A profile's keys, kept per text as the parse is: read for every node of every decision.
@functools.lru_cache(maxsize=4096)
def weights_key(model: str, sha256: str, model_path: str) -> str:
    """`ModelRef.weights_key` of `model:` as a profile gives it."""
    return parse_model(model, sha256).weights_key(model_path)


@functools.lru_cache(maxsize=4096)
def staged_key(model: str, sha256: str) -> str:
    """`ModelRef.staged_key` of `model:` as a profile gives it."""
    return parse_model(model, sha256).staged_key()


@functools.lru_cache(maxsize=4096)
def node_file(model: str, sha256: str, model_path: str) -> str:
    """`ModelRef.node_file` of `model:` as a profile gives it."""
    return parse_model(model, sha256).node_file(model_path)
