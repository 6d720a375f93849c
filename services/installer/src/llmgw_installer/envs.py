"""vLLM and SGLang as Python environments, built on the node from the lock `engines:` stores.

lock -> variant for this node -> disk space -> `uv venv` (the node's own Python) in
staging -> `uv pip install --require-hashes --no-deps --only-binary :all:` -> import the
engine with that interpreter, its version the lock's -> its server's `--help` -> marker,
rename into place. Every step is said when it starts (`installing vllm 0.32.0 (cpu):
...`); a failure is said by name (`vllm 0.32.0 (cpu): import failed: <last line>`),
its staging directory removed, and nothing is reported installed.

Why uv: it installs a few GB of wheels in seconds (hardlinked from its cache), checks
every wheel's sha256 against the lock (`--require-hashes`), and never resolves
(`--no-deps`): the lock is the whole wheel set. `--only-binary :all:` keeps a sdist's
build scripts from running on the node. The environment is `--relocatable`, so its
scripts (`ray`) still run once renamed from staging into place.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

import anyio
import msgspec

from llmgw_core.events import EngineSpec, EngineState, NodeFacts
from llmgw_core.installed import MARKER, InstalledEngine, read_marker

from .errors import CheckError, InstallError, NoBuildError
from .lock import SGLANG_NO_CPU, Lock, LockError, parse, render
from .pipeline import Installation, InstallContext
from .process import TimedOut, run_bounded
from .wheels import PYPI, Gather

ENV_ENGINES = frozenset({"vllm", "sglang"})
# The module each engine's OpenAI server runs as (what the launcher starts).
SERVER_MODULE = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}
# Unpacked wheels take about twice their size, and uv's cache holds the wheels themselves
# where it cannot hardlink.
DISK_FACTOR = 3
# The environment's variables that would make its interpreter import another tree's packages.
_LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")
_CUDA_VARIANT = re.compile(r"cu(\d{2,3})")


class EnvError(InstallError):
    """A step of building the environment failed; the message names the engine and the step."""


def cuda_of(variant: str) -> tuple[int, int] | None:
    """`cu128` -> (12, 8), `cu130` -> (13, 0); None for `cpu` and other non-CUDA variants."""
    hit = _CUDA_VARIANT.fullmatch(variant)
    if hit is None:
        return None
    digits = hit.group(1)
    return int(digits[:-1]), int(digits[-1])


def _driver_cuda(facts: NodeFacts) -> tuple[int, int] | None:
    hit = re.match(r"(\d{1,3})\.(\d{1,3})", facts.cuda_driver)
    return (int(hit.group(1)), int(hit.group(2))) if hit else None


def choose(spec: EngineSpec, lock: Lock, facts: NodeFacts) -> str:
    """Words for a GPU node given the CPU build (its `cpu_only`), "" otherwise; NoBuildError where
    the lock's variant cannot run here. The node's own variant: `cpu` without an NVIDIA driver,
    the CUDA build its driver supports with one."""
    if spec.variant and spec.variant != lock.variant:
        raise NoBuildError(
            f"{lock.label}: engines: asks for variant {spec.variant}, but its lock is for {lock.variant}; "
            f"write the lock with `llmgw engines lock {lock.engine} {lock.version} --variant {spec.variant}`"
        )
    cuda = cuda_of(lock.variant)
    if lock.engine == "sglang" and cuda is None:
        raise NoBuildError(SGLANG_NO_CPU.format(label=lock.label))
    driver = _driver_cuda(facts) if facts.nvidia_driver and not facts.simulated else None
    if cuda is None:
        if driver is None or spec.variant == "cpu":
            return ""
        return (
            f"the lock is for {lock.engine}'s {lock.variant} build and this node's driver supports "
            f"CUDA {facts.cuda_driver}; lock the CUDA build for it "
            f"(--variant cu{driver[0]}{driver[1]} or older)"
        )
    if driver is None:
        instead = (
            "SGLang has no CPU build: serve CPU profiles here with vLLM or llama.cpp"
            if lock.engine == "sglang"
            else "lock the cpu variant for it"
        )
        raise NoBuildError(
            f"{lock.label} needs an NVIDIA driver for CUDA {cuda[0]}.{cuda[1]}; this node has none "
            f"({instead})"
        )
    if cuda > driver:
        raise NoBuildError(
            f"{lock.engine} {lock.version} has wheels for CUDA {cuda[0]}.{cuda[1]} in this lock; "
            f"this driver supports {facts.cuda_driver} (lock a variant for CUDA "
            f"{facts.cuda_driver} or older, or upgrade the driver)"
        )
    return ""


def source_args(source: str) -> list[str]:
    """uv's options for where the wheels come from: the default index, an index URL, a wheelhouse."""
    if not source:
        return []
    if (
        source.startswith(("https://", "http://"))
        and len(source) <= 2048
        and not any(c.isspace() for c in source)
    ):
        return ["--index-url", source]
    if source.startswith("/") and "\x00" not in source:
        return ["--no-index", "--find-links", source]
    raise EnvError(
        f"source {source[:80]!r} is neither an index URL (https://...) nor a wheelhouse directory "
        "(an absolute path); leave it out for the package index"
    )


def origin_of(source: str) -> str:
    """The index a lock's wheels are gathered from (and shared between nodes), or "" where uv
    installs them itself: from a wheelhouse (already on this node), or with `UV_OFFLINE` set
    (uv's cache only: the node may not reach an index)."""
    if source.startswith("/") or os.environ.get("UV_OFFLINE", "").lower() in ("1", "true", "yes"):
        return ""
    return source or PYPI


def digest(lock: Lock) -> str:
    return hashlib.sha256(render(lock).encode()).hexdigest()


def lock_of(spec: EngineSpec) -> Lock | None:
    """The spec's lock, or None where it names none or it cannot be read."""
    try:
        return parse(spec.lock) if spec.lock else None
    except LockError:
        return None


def wanted_dir(root: Path, spec: EngineSpec) -> Path | None:
    """Where this spec's environment lives (`<root>/vllm/0.32.0-cpu`); None without a readable lock."""
    try:
        lock = parse(spec.lock)
    except LockError:
        return None
    return root / spec.name / f"{lock.version}-{lock.variant}"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LEAKY_ENV}


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(no output)"


def uv_failure(text: str) -> str:
    """uv's own reason, in one line: its `error:` line and what follows it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if line.startswith("error:")), max(0, len(lines) - 3))
    said = ""
    for line in lines[first : first + 6]:
        # `Expected:` and the hash on the next line read as one clause.
        said += (" " if said.endswith(":") else "; " if said else "") + line
    return said[:600] or "(no output)"


def run_checked(argv: list[str], timeout: float, what: str) -> str:
    """Run a step; its stdout, or EnvError with `what` and the step's last line."""
    try:
        done = run_bounded(argv, timeout, env=clean_env())
    except TimedOut as exc:
        raise EnvError(f"{what}: no answer in {timeout:.0f} s: {last_line(exc.output)}") from exc
    except OSError as exc:
        raise EnvError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        words = uv_failure(done.output) if argv[1:3] == ["pip", "install"] else last_line(done.output)
        raise EnvError(f"{what}: {words}")
    return done.stdout


def engine_version(python: Path, engine: str, distribution: str, timeout: float) -> tuple[str, str]:
    """(the engine's own `__version__`, its distribution's version), read by importing it.

    Isolated (`-I`): a `vllm/` directory where the installer happens to run, or a PYTHONPATH,
    would otherwise be imported in the environment's place and pass the check."""
    code = (
        "import importlib.metadata as m\n"
        f"import {engine}\n"
        f"print({engine}.__version__)\n"
        f"print(m.version({distribution!r}))\n"
    )
    out = run_checked([str(python), "-I", "-c", code], timeout, "import failed").splitlines()
    if len(out) < 2:
        raise EnvError(f"import failed: {engine} printed no version")
    return out[-2].strip()[:64], out[-1].strip()[:64]


def distribution_version(python: Path, distribution: str, timeout: float) -> str:
    """The cheap recheck: the environment's interpreter runs and names its distribution's version."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    return last_line(run_checked([str(python), "-I", "-c", code], timeout, "recheck failed"))


def in_use(path: Path, proc: Path = Path("/proc")) -> bool:
    """Whether a process runs from `path`: its command line names a file under it (the launcher
    starts engines by their environment's own interpreter)."""
    prefix = str(path).encode() + b"/"
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            args = (pid / "cmdline").read_bytes()[:65536].split(b"\0")
        except OSError:
            continue
        if any(a.startswith(prefix) for a in args):
            return True
    return False


def remove_unwanted(root: Path, wanted: set[Path]) -> list[str]:
    """Remove the environments of vLLM and SGLang no longer wanted and not in use; returns them."""
    removed = []
    for name in sorted(ENV_ENGINES):
        engine_dir = root / name
        if not engine_dir.is_dir():
            continue
        for env_dir in sorted(engine_dir.iterdir()):
            if env_dir in wanted or not (env_dir / MARKER).exists() or in_use(env_dir):
                continue
            shutil.rmtree(env_dir, ignore_errors=True)
            removed.append(f"{name}/{env_dir.name}")
    return removed


class EnvInstallation(Installation):
    """One vLLM or SGLang environment: installed from its lock, or rechecked."""

    def __init__(self, spec: EngineSpec, ctx: InstallContext, uv: str) -> None:
        super().__init__(spec, ctx)
        self.uv = uv
        self.label = f"{spec.name} {spec.version}"

    async def run(self) -> EngineState:
        try:
            lock = self._lock()
            cpu_only = choose(self.spec, lock, self.ctx.facts)
        except InstallError as exc:
            return await self.fail("resolving", str(exc))
        self.label = lock.label
        final = self.ctx.root / self.name / f"{lock.version}-{lock.variant}"
        marker = read_marker(final)
        if marker is not None and marker.sha256 == digest(lock):
            return await self.recheck_env(final, lock, marker)
        try:
            return await self._build(final, lock, cpu_only)
        except InstallError as exc:
            return await self.fail("failed", f"{lock.label}: {exc}")

    def _lock(self) -> Lock:
        if not self.spec.lock:
            raise EnvError(
                f"{self.label}: engines: names no lock for it; write one with `llmgw engines lock "
                f"{self.name} {self.spec.version} --variant cpu -o FILE` and put its text under lock:"
            )
        try:
            lock = parse(self.spec.lock)
        except LockError as exc:
            raise EnvError(f"{self.label}: the lock is refused: {exc}") from exc
        if lock.engine != self.name or lock.version != self.spec.version:
            raise EnvError(f"{self.label}: the lock under it is for {lock.label}")
        source_args(self.spec.source)
        return lock

    async def recheck_env(self, final: Path, lock: Lock, marker: InstalledEngine) -> EngineState:
        """The cheap checks again (the interpreter runs, the distribution's version is the lock's);
        the import and `--help` ran at install."""
        python = Path(marker.bin_dir) / "python"
        seen = {"version": self.tag, "path": marker.bin_dir, "cpu_only": marker.cpu_only}
        try:
            found = await anyio.to_thread.run_sync(
                distribution_version, python, lock.distribution, self.ctx.version_timeout_s
            )
            if found != lock.version:
                raise CheckError(
                    f"recheck failed: {lock.distribution} is {found}, the lock says {lock.version}"
                )
        except InstallError as exc:
            return EngineState(
                name=self.name,
                state="broken",
                engine_version=marker.version,
                detail=f"{lock.label}: {exc}",
                **seen,
            )
        return EngineState(name=self.name, state="installed", engine_version=marker.version, **seen)

    async def say(self, step: str, words: str) -> None:
        await self.step(step, f"installing {self.label}: {words}")

    async def _gather(self, lock: Lock, origin: str) -> list[str]:
        """The lock's wheels in a directory of their own (peers first, the origin once), and uv's
        options to install from it alone."""

        async def say(words: str) -> None:
            await self.say("download", words)

        await say(f"gathering {len(lock.packages)} wheels (from peers first; sha256 checked)")
        gather = Gather(
            lock=lock,
            digest=digest(lock),
            wheel_root=self.ctx.root / ".wheels",
            origin=origin,
            client=self.ctx.client,
            share=self.ctx.wheels,
            say=say,
            wait_s=self.ctx.env_timeout_s,
        )
        try:
            wheel_dir = await gather.run()
        except InstallError as exc:
            raise EnvError(f"fetching its wheels failed: {exc}") from exc
        return ["--no-index", "--find-links", str(wheel_dir)]

    async def _build(self, final: Path, lock: Lock, cpu_only: str) -> EngineState:
        uv_source = source_args(self.spec.source)
        await self.say("resolving", "checking disk space")
        final.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(final.parent).free
        if lock.total_bytes and lock.total_bytes * DISK_FACTOR > free:
            raise EnvError(
                f"not enough disk: its wheels take {lock.total_bytes // 10**6} MB (about "
                f"{lock.total_bytes * DISK_FACTOR // 10**6} MB installed), {free // 10**6} MB free "
                f"under {final.parent}"
            )
        origin = origin_of(self.spec.source)
        if origin:
            uv_source = await self._gather(lock, origin)
        staging = (
            self.ctx.root / ".staging" / f"{self.name}-{lock.version}-{lock.variant}-{uuid.uuid4().hex[:8]}"
        )
        tree = staging / "tree"
        env = tree / "env"
        python = env / "bin" / "python"
        timeout = self.ctx.env_timeout_s
        try:
            tree.mkdir(parents=True)
            await self.say("environment", f"making a Python environment for {sys.version.split()[0]}")
            venv = [
                self.uv,
                "venv",
                "--no-config",
                "--quiet",
                "--relocatable",
                "--python",
                sys.executable,
                str(env),
            ]
            await anyio.to_thread.run_sync(run_checked, venv, timeout, "making the environment failed")
            (tree / "lock.txt").write_text(render(lock))
            await self.say("packages", f"installing {len(lock.packages)} wheels (sha256 checked)")
            install = [
                self.uv, "pip", "install", "--no-config", "--python", str(python),
                "--require-hashes", "--no-deps", "--only-binary", ":all:",
                *uv_source, "-r", str(tree / "lock.txt"),
            ]  # fmt: skip
            try:
                await anyio.to_thread.run_sync(run_checked, install, timeout, "install failed")
            except EnvError:
                if origin:
                    # A gathered wheel uv refuses (changed on this disk since) is gathered again
                    # at the next attempt, not refused for ever.
                    shutil.rmtree(self.ctx.root / ".wheels" / digest(lock), ignore_errors=True)
                raise
            await self.say("checking", f"importing {self.name}")
            own, dist = await anyio.to_thread.run_sync(
                engine_version, python, self.name, lock.distribution, timeout
            )
            if own.split("+")[0] != lock.version or dist != lock.version:
                raise CheckError(f"version check failed: {self.name} says {own} ({lock.distribution} {dist})")
            await self.say("version", f"running {SERVER_MODULE[self.name]} --help")
            help_argv = [str(python), "-I", "-m", SERVER_MODULE[self.name], "--help"]
            await anyio.to_thread.run_sync(run_checked, help_argv, timeout, "--help failed")
            bin_dir = final / "env" / "bin"
            marker = InstalledEngine(
                name=self.name,
                tag=self.tag,
                version=f"{lock.distribution} {dist}",
                bin_dir=str(bin_dir),
                asset=lock.label,
                sha256=digest(lock),
                installed_at=time.time(),
                cpu_only=cpu_only,
                cuda_driver=self.ctx.facts.cuda_driver,
            )
            (tree / MARKER).write_bytes(msgspec.json.encode(marker))
            if final.exists():
                shutil.rmtree(final)
            # The commit point: the environment, marker inside, appears in one rename.
            os.replace(tree, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        await self.step("installed", f"installed {lock.label} in {final} ({marker.version})", "done")
        return EngineState(
            name=self.name,
            state="installed",
            version=self.tag,
            path=str(bin_dir),
            engine_version=marker.version,
            cpu_only=cpu_only,
        )
