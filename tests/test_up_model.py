"""`llmgw up --model`: a newcomer's one command, answered by the real llama.cpp through the gateway."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llmgw.up import model_name, model_profile, model_source
from llmgw_core.engines import GPUInfo
from tests.cluster_support import up_engine_ports
from tests.hf_server import hf_hub
from tests.launcher_support import pid_alive, processes_with
from tests.test_launcher_llamacpp import llama_bin
from tests.test_sim_engine import free_port
from tests.test_up import ROOT, free_block, printed_key, up_here
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

__all__ = ["llama_bin"]

# A real engine on two busy cores: a chat turn of the tiny model takes seconds to tens of seconds.
READY_TIMEOUT_S = 300.0


async def up_with_model(
    tmp_path: Path, model: str, env: dict[str, str] | None = None
) -> tuple[str, Path, list[dict[str, object]]]:
    """Run `llmgw up --model <model>` in tmp_path as its own process group, wait for its endpoint,
    chat through the gateway by both names, then Ctrl-C it: what it printed first, its data dir
    and the answers."""
    data = tmp_path / "cluster"
    out = tmp_path / "up.log"
    argv = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "up"]
    argv += ["--model", model, "--data-dir", str(data), "--port", str(free_port())]
    argv += ["--api-port", str(free_block(4)), "--gateway-port", str(free_port()), *up_engine_ports()]
    with out.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:

        def endpoint() -> str:
            text = out.read_text(errors="replace")
            assert proc.poll() is None, text
            found = re.search(
                r"the endpoint, OpenAI base_url: (http://\S+)/v1 \(model 'chat', or 'tiny'\)", text
            )
            assert found, text[-2000:]
            return found.group(1)

        url = await eventually(endpoint, timeout=READY_TIMEOUT_S, interval=0.5)
        text = out.read_text()
        assert f"curl -s {url}/v1/chat/completions" in text
        answers = []
        async with httpx.AsyncClient(timeout=120) as client:
            for name in ("chat", "tiny"):
                r = await client.post(
                    f"{url}/v1/chat/completions",
                    json={"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
                    headers=printed_key(text),
                )
                assert r.status_code == 200, r.text
                answers.append(r.json())
        engines = processes_with("llama-server", under=data)
        assert len(engines) == 1, "one llama-server"

        # Ctrl-C, as a terminal sends it: to the process group recorded at the start.
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        await eventually(lambda: "llmgw: stopped" in out.read_text(), timeout=60)
        await eventually(lambda: [p for p in engines if pid_alive(p)] == [], timeout=60)
        await eventually(lambda: processes_with(str(data)) == [], timeout=60)
        assert proc.returncode == 0, out.read_text()[-2000:]
        return text.splitlines()[0], data, answers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def answered_by_llama_cpp(answers: list[dict[str, object]]) -> None:
    for answer in answers:
        assert answer["model"] == "tiny"
        # llama-server's own fields: the real engine answered, not the simulated one.
        timings = answer["timings"]
        assert isinstance(timings, dict)
        assert timings["predicted_n"] >= 1, answer


@pytest.mark.anyio
@pytest.mark.llama
@pytest.mark.timeout(600)
async def test_up_with_a_local_gguf_answers_a_chat_from_the_real_llama_cpp(
    tmp_path: Path, llama_bin: str
) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    first, data, answers = await up_with_model(tmp_path, "./tiny.gguf")
    # Where it runs, said before anything starts.
    assert first.startswith(f"llmgw: model tiny (file://{model}): "), first
    if "no GPU found" in first:
        assert first.endswith("no GPU found: llama.cpp runs the model on the CPU"), first
    answered_by_llama_cpp(answers)
    # The engine read the operator's file where it is.
    log = next((data / "agent" / "logs").rglob("*llama-server.log")).read_text()
    assert f"loading model '{model}'" in log


@pytest.mark.anyio
@pytest.mark.llama
@pytest.mark.timeout(600)
async def test_up_with_an_hf_gguf_stages_it_and_answers_from_the_real_llama_cpp(
    tmp_path: Path, llama_bin: str
) -> None:
    gguf = write_tiny_llama(tmp_path / "src.gguf").read_bytes()
    with hf_hub() as hub:
        hub.add("org/repo", {"tiny.gguf": gguf})
        commit = hub.state.repos["org/repo"].commit
        first, data, answers = await up_with_model(
            tmp_path, "hf://org/repo/tiny.gguf", {"HF_ENDPOINT": hub.url}
        )
        assert hub.state.served["tiny.gguf"] == len(gguf)
    assert first.startswith("llmgw: model tiny (hf://org/repo/tiny.gguf): "), first
    answered_by_llama_cpp(answers)
    staged = data / "agent" / "models" / "hf" / "org" / "repo" / commit / "files" / "tiny.gguf"
    assert staged.read_bytes() == gguf
    log = next((data / "agent" / "logs").rglob("*llama-server.log")).read_text()
    assert f"loading model '{staged}'" in log


def test_up_refuses_a_model_it_cannot_run_before_starting_anything(tmp_path: Path) -> None:
    missing = up_here("--model", "./no-such.gguf", "--data-dir", str(tmp_path / "d"))
    assert missing.returncode == 1
    assert missing.stderr == (
        f"llmgw: --model ./no-such.gguf: no such file ({ROOT / 'no-such.gguf'}); give a GGUF file on this "
        "machine or hf://<org>/<repo>/<file>.gguf\n"
    )
    url = up_here("--model", "https://example.org/x.gguf", "--data-dir", str(tmp_path / "d"))
    assert url.returncode == 1
    assert url.stderr == (
        "llmgw: --model https://example.org/x.gguf: give hf://<org>/<repo>/<file>.gguf or a GGUF file "
        "on this machine (an https:// URL needs its sha256: put it in a server.yaml profile with "
        "model_sha256)\n"
    )
    nodes = up_here("--model", "hf://org/repo/x.gguf", "--nodes", "2", "--data-dir", str(tmp_path / "d"))
    assert nodes.returncode == 1
    assert nodes.stderr == "llmgw: --model runs the model on this machine's one node; drop --nodes 2\n"
    assert not (tmp_path / "d").exists()


def test_the_model_is_named_by_its_file_and_placed_on_a_gpu_when_there_is_one(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert model_source("x.gguf", tmp_path) == f"file://{tmp_path}/x.gguf"
    assert model_source(
        "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf@main", tmp_path
    )
    assert model_name("hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf@main") == (
        "qwen2-5-0-5b-instruct-q4_k_m"
    )
    assert model_name(f"file://{tmp_path}/x.gguf") == "x"
    cpu = model_profile("hf://o/r/m.gguf")
    assert cpu == {
        "name": "m",
        "engine": "llamacpp",
        "model": "hf://o/r/m.gguf",
        "args": ["-c", "4096"],
        "health_timeout_s": 600,
    }
    gpu = model_profile(
        "hf://o/r/m.gguf", (GPUInfo(index=0, name="NVIDIA L40S", memory_mb=46068),), "L40S-48G"
    )
    assert gpu == {**cpu, "gpu_class": "L40S-48G", "tp": 1}
