from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.metrics_support import value
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sim() -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw_core.sim",
            "--port",
            str(port),
            "--model",
            "tiny",
            "--load-time",
            "1.0",
            "--tokens-per-second",
            "500",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


async def test_sim_loads_serves_streams_and_exits_cleanly(
    sim: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = sim
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:

        async def health() -> bool:
            try:
                r = await client.get("/health")
            except httpx.TransportError:
                return False
            statuses.append(r.status_code)
            return r.status_code == 200

        await eventually(health, timeout=10)
        assert statuses[0] == 503
        assert statuses[-1] == 200

        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]

        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
        }
        pieces: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream"
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for line in events[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            assert chunk["object"] == "chat.completion.chunk"
            pieces.append(chunk["choices"][0]["delta"].get("content", ""))
        streamed = "".join(pieces)
        assert len(streamed.split()) == 5

        plain = (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
        assert plain["choices"][0]["message"]["content"] == streamed, "output is deterministic"

        metrics = (await client.get("/metrics")).text
        assert value(metrics, "llmgw_sim_requests_total") == 2
        assert value(metrics, "llmgw_sim_generation_tokens_total") == 10
        assert value(metrics, "llmgw_sim_loading") == 0

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_sim_refuses_to_start_with_its_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_core.sim", "--refuse", "out of memory"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "llmgw-sim: refusing to start: out of memory"


def test_sim_exits_with_the_code_it_was_given() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw_core.sim",
            "--port",
            "0",
            "--exit-after",
            "0.2",
            "--exit-code",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 7


async def test_sim_fails_health_after_the_time_it_was_given() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_core.sim", "--port", str(port), "--fail-health-after", "0.5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    codes: list[int] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            async def health() -> bool:
                try:
                    codes.append((await client.get("/health")).status_code)
                except httpx.TransportError:
                    return False
                return codes[-1] == 503 and 200 in codes

            await eventually(health, timeout=10)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert codes[0] == 200
    assert codes[-1] == 503
