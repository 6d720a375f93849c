"""The benchmark's load generator (`bench.load`) against real servers on loopback: it counts
answers only when they are whole and 200, by Content-Length or chunked."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.gateway import pin
from bench.load import measure, read_answer
from tests.test_gateway_api import sim_engines
from tests.waiting import eventually

ROOT = Path(__file__).parent.parent
CHAT = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


def serving(url: str) -> None:
    def health() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError as exc:
            raise AssertionError(f"{url} not serving yet: {exc}") from exc

    asyncio.run(eventually(health, timeout=60, interval=0.1))


def test_counts_every_answer_of_a_sim_engine_and_no_error() -> None:
    with sim_engines([]) as (url,):
        serving(url)
        done = asyncio.run(measure(f"{url}/v1/chat/completions", CHAT, "", 4, 0.5))
    assert done["errors"] == 0
    assert isinstance(done["latencies_s"], list)
    assert done["done"] == len(done["latencies_s"]) > 0


def test_a_chunked_answer_is_read_whole_and_each_status_and_close_said() -> None:
    answers = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}"
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    )

    async def main() -> list[tuple[int, bool]]:
        reader = asyncio.StreamReader()
        reader.feed_data(answers)
        reader.feed_eof()
        return [await read_answer(reader) for _ in range(3)]

    assert asyncio.run(main()) == [(200, True), (429, True), (200, False)]


def test_runs_as_its_own_process_and_prints_json(tmp_path: Path) -> None:
    body = tmp_path / "chat.json"
    body.write_bytes(CHAT)
    with sim_engines([]) as (url,):
        serving(url)
        argv = [sys.executable, "-m", "bench.load", f"{url}/v1/chat/completions", "--body", str(body)]
        done = subprocess.run([*argv, "--duration", "0.3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["errors"] == 0
    assert result["done"] > 0


def test_pin_moves_every_thread_of_a_running_process() -> None:
    """The gateway benchmark's CPU of its own: affinity is per thread, so threads a process
    started before it was pinned are pinned too, and unpinned after."""
    everywhere = os.sched_getaffinity(0)
    one = {min(everywhere)}
    with subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, threading; threading.Thread(target=sys.stdin.read).start(); print(flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"\n"  # its thread runs
            tasks = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
            assert len(tasks) == 2
            pin(child.pid, one)
            assert [os.sched_getaffinity(t) for t in tasks] == [one, one]
            pin(child.pid, everywhere)
            assert [os.sched_getaffinity(t) for t in tasks] == [everywhere, everywhere]
        finally:
            child.kill()


@pytest.mark.parametrize("kind", ["bare", "uvicorn"])
def test_a_floor_proxy_passes_every_request_and_answer_whole(kind: str, tmp_path: Path) -> None:
    """The gateway benchmark's reference proxies (`bench/floor_proxy.py`): the engine's answers
    come back whole through them, one after another on kept-alive connections, 4 at a time."""
    log = tmp_path / "floor.log"
    with sim_engines([]) as (url,), log.open("wb") as out:
        serving(url)
        argv = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), kind, url]
        proxy = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = asyncio.run(eventually(lambda: _endpoint(log), timeout=30, interval=0.1))
            answer = httpx.post(f"{base}/v1/chat/completions", content=CHAT, timeout=10)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"
            done = asyncio.run(measure(f"{base}/v1/chat/completions", CHAT, "", 4, 0.5))
        finally:
            os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(timeout=10)
    assert done["errors"] == 0
    assert done["done"] > 4


def _endpoint(log: Path) -> str:
    found = re.search(r"OpenAI endpoint on (http://\S+)/v1", log.read_text())
    assert found, log.read_text()
    return found.group(1)
