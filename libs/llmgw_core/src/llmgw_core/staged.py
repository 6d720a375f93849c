"""Where a node keeps the weights it staged (`<state_dir>/models`), and what it holds.

The launcher writes this layout (`llmgw_launcher.weights`); the node probe reads it back as
the weights the node reports, keyed as a profile's `weights_key` names them, so placement can
prefer a node that already holds a profile's weights.

    blobs/<algo>-<hex>                         verified files, named by content
    hf/<org>/<repo>/<commit>/files/<file>      one file of a repository
    hf/<org>/<repo>/<commit>/snapshot/         a whole repository
    hf/<org>/<repo>/refs/<revision>            the commit a branch or tag resolved to when last staged
    url/<sha256>/<name>                        a file from a URL
"""

from __future__ import annotations

from pathlib import Path

from .engines import ModelSource


def hf_dir(root: Path, source: ModelSource) -> Path:
    return root / "hf" / source.repo


def hf_view(root: Path, source: ModelSource, commit: str) -> Path:
    base = hf_dir(root, source) / commit
    return base / "files" / source.file if source.file else base / "snapshot"


def url_view(root: Path, source: ModelSource) -> Path:
    return root / "url" / source.sha256 / source.name


def held(root: Path) -> dict[str, str]:
    """Every source staged under `root`, as `weights_key` names it, to the commit or digest it holds.

    A branch counts as held at the commit it resolved to when last staged. Reading only
    directory names (and the small ref files), it costs no read of any model.
    """
    found: dict[str, str] = {}
    hf = root / "hf"
    for repo_dir in _dirs(hf, depth=2):
        repo = "/".join(repo_dir.relative_to(hf).parts)
        by_commit: dict[str, list[str]] = {}
        for commit_dir in _dirs(repo_dir):
            if commit_dir.name == "refs":
                continue
            commit = commit_dir.name
            keys = by_commit.setdefault(commit, [])
            if (commit_dir / "snapshot").is_dir():
                keys.append(f"hf://{repo}")
            files = commit_dir / "files"
            for f in sorted(files.rglob("*")) if files.is_dir() else ():
                if f.is_file() and not f.name.startswith("."):
                    keys.append(f"hf://{repo}/{f.relative_to(files).as_posix()}")
        for commit, keys in by_commit.items():
            for key in keys:
                found[f"{key}@{commit}"] = commit[:16]
        refs = repo_dir / "refs"
        for ref in sorted(refs.rglob("*")) if refs.is_dir() else ():
            if not ref.is_file() or ref.name.startswith("."):
                continue
            try:
                commit = ref.read_text().strip()
            except OSError:
                continue
            for key in by_commit.get(commit, ()):
                found[f"{key}@{ref.relative_to(refs).as_posix()}"] = commit[:16]
    for digest_dir in _dirs(root / "url"):
        if any(p.is_file() and not p.name.startswith(".") for p in digest_dir.iterdir()):
            found[f"sha256:{digest_dir.name}"] = digest_dir.name[:16]
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
