"""Where a node keeps the weights it staged (`<state_dir>/models`), and what it holds.

The launcher writes this layout (`llmgw_launcher.weights`); the node probe reads it back as
the weights the node reports, keyed as a profile's `weights_key` names them, so placement can
prefer a node that already holds a profile's weights.

    blobs/<algo>-<hex>                         verified files, named by content
    hf/<org>/<repo>/<commit>/files/<file>      one file of a repository
    hf/<org>/<repo>/<commit>/snapshot/         a whole repository
    hf/<org>/<repo>/refs/<revision>            the commit a branch or tag resolved to when last staged
    url/<sha256>/<name>                        a file from a URL
    <dir>/.<view>.shape.json                   the model's shape (`ModelShape`), read from its
                                               headers once when staged
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from .engines import ModelSource
from .events import ModelShape

log = logging.getLogger("llmgw.staged")
_shape_decoder = msgspec.json.Decoder(ModelShape)


def hf_dir(root: Path, source: ModelSource) -> Path:
    return root / "hf" / source.repo


def hf_view(root: Path, source: ModelSource, commit: str) -> Path:
    base = hf_dir(root, source) / commit
    return base / "files" / source.file if source.file else base / "snapshot"


def url_view(root: Path, source: ModelSource) -> Path:
    return root / "url" / source.sha256 / source.name


def shape_file(view: Path) -> Path:
    """Where the shape of the model at `view` is kept: a dot-file beside it."""
    return view.parent / f".{view.name}.shape.json"


def recorded_shape(view: Path) -> ModelShape | None:
    """The shape recorded beside the model at `view` when it was staged, None where it has none
    (weights that are not a model, an architecture without the counts)."""
    return _read_shape_file(shape_file(view))


def held(root: Path) -> dict[str, str]:
    """Every source staged under `root`, as `weights_key` names it, to the commit or digest it holds.

    A branch counts as held at the commit it resolved to when last staged. Reading only
    directory names (and the small ref files), it costs no read of any model.
    """
    return {key: digest for key, (digest, _view) in _held_views(root).items()}


def shapes(root: Path) -> dict[str, ModelShape]:
    """The shape of every model staged under `root` that has one recorded, keyed as `held` keys it."""
    found: dict[str, ModelShape] = {}
    read: dict[Path, ModelShape | None] = {}
    for key, (_digest, view) in _held_views(root).items():
        if view not in read:
            read[view] = _read_shape_file(shape_file(view))
        shape = read[view]
        if shape is not None:
            found[key] = shape
    return found


def _read_shape_file(path: Path) -> ModelShape | None:
    try:
        return _shape_decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        # A shape that cannot be read costs the fit check for this model, never the probe.
        log.warning("cannot read %s: %s", path, exc)
        return None


def _held_views(root: Path) -> dict[str, tuple[str, Path]]:
    """`held`'s keys, each to the digest it holds and the view the engine reads."""
    found: dict[str, tuple[str, Path]] = {}
    hf = root / "hf"
    for repo_dir in _dirs(hf, depth=2):
        repo = "/".join(repo_dir.relative_to(hf).parts)
        by_commit: dict[str, list[tuple[str, Path]]] = {}
        for commit_dir in _dirs(repo_dir):
            if commit_dir.name == "refs":
                continue
            commit = commit_dir.name
            keys = by_commit.setdefault(commit, [])
            if (commit_dir / "snapshot").is_dir():
                keys.append((f"hf://{repo}", commit_dir / "snapshot"))
            files = commit_dir / "files"
            for f in sorted(files.rglob("*")) if files.is_dir() else ():
                if f.is_file() and not f.name.startswith("."):
                    keys.append((f"hf://{repo}/{f.relative_to(files).as_posix()}", f))
        for commit, keys in by_commit.items():
            for key, view in keys:
                found[f"{key}@{commit}"] = (commit[:16], view)
        refs = repo_dir / "refs"
        for ref in sorted(refs.rglob("*")) if refs.is_dir() else ():
            if not ref.is_file() or ref.name.startswith("."):
                continue
            try:
                commit = ref.read_text().strip()
            except OSError:
                continue
            for key, view in by_commit.get(commit, ()):
                found[f"{key}@{ref.relative_to(refs).as_posix()}"] = (commit[:16], view)
    for digest_dir in _dirs(root / "url"):
        named = [p for p in sorted(digest_dir.iterdir()) if p.is_file() and not p.name.startswith(".")]
        if named:
            found[f"sha256:{digest_dir.name}"] = (digest_dir.name[:16], named[0])
    return dict(sorted(found.items()))


def _dirs(path: Path, depth: int = 1) -> list[Path]:
    level = [path]
    for _ in range(depth):
        nxt: list[Path] = []
        for d in level:
            try:
                nxt += sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
        level = nxt
    return level
