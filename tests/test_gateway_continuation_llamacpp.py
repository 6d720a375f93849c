"""The real thing: two llama.cpp servers behind the gateway at temperature 0, the one answering
killed by its pid mid-stream; the gateway continues the answer on the other by prefill (the
partial answer as the last assistant message, which llama-server continues and streams back
first: dropped), and the client's text equals the uncut answer, character for character.

The tiny model's vocabulary has no merges, so a word it generates as one token is read back,
in a prompt, as its letters' byte tokens: text spliced at a word would go on from another
context. The requests allow only printable ASCII byte tokens (`logit_bias`), which read back
as the very tokens generated: the splice is then exact, as it is for a real model's text
wherever its tokenizer reads back what it wrote."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_support import proxy_over
from tests.test_gateway import metric
from tests.test_gateway_continuation import events_of, stream, text_of
from tests.test_launcher_llamacpp import llama_bin  # noqa: F401 (a fixture)
from tests.test_sim_engine import free_port
from tests.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.anyio, pytest.mark.llama, pytest.mark.timeout(180)]

# Printable ASCII but space (byte tokens 3 + 0x21 … 3 + 0x7e): every other token is banned.
ALLOWED = range(3 + 0x21, 3 + 0x7F)
VOCAB = 3 + 256 + 10
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 200,
    "temperature": 0,
    "logit_bias": [[i, False] for i in range(VOCAB) if i not in ALLOWED],
}


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough that one thread streams about 70 tokens a second: a kill lands mid-answer."""
    path = tmp_path_factory.mktemp("models") / "mid-llama.gguf"
    return write_tiny_llama(path, n_embd=512, n_head=8, n_ff=2048, n_layer=4)


@pytest.fixture
def llama_servers(llama_bin: str, slow_model: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:  # noqa: F811
    servers = []
    env = {**os.environ, "LD_LIBRARY_PATH": llama_bin}
    try:
        for _ in range(2):
            port = free_port()
            argv = [
                f"{llama_bin}/llama-server",
                "-m",
                str(slow_model),
                "--port",
                str(port),
                "-c",
                "512",
                "-t",
                "1",
            ]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            servers.append((f"http://127.0.0.1:{port}", proc))
        yield servers
    finally:
        for _, proc in servers:
            proc.kill()
            proc.wait()


async def test_a_llama_cpp_answer_killed_mid_stream_is_continued_by_prefill_as_the_uncut_text(
    llama_servers: list[tuple[str, subprocess.Popen[bytes]]],
) -> None:
    urls = [url for url, _ in llama_servers]
    async with proxy_over(urls, engine="llamacpp", timeout_s=60) as gw, httpx.AsyncClient(timeout=60) as raw:
        uncut = await stream(raw, urls[1], "/v1/chat/completions", BODY)
        whole = text_of(uncut, chat=True)
        assert len(whole) == 200, whole  # one character a token
        received = b""
        async with raw.stream("POST", f"{gw.url}/v1/chat/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            killed = None
            async for chunk in r.aiter_raw():
                received += chunk
                if killed is None and received.count(b'"content"') > 20:
                    [killed] = [i for i in (0, 1) if gw.table.outstanding[f"chat.r{i}"]]
                    os.kill(llama_servers[killed][1].pid, signal.SIGKILL)
        scrape = (await raw.get(f"{gw.url}/metrics")).text
    got = events_of(received)
    assert got[-1] == "[DONE]"
    assert not any("error" in e for e in got if isinstance(e, dict)), got[-3:]
    assert len({e["id"] for e in got[:-1]}) == 1
    assert metric(scrape, 'llmgw_gateway_continued_total{cause="connection_lost",deployment="chat"}') == 1
    # Continued where the kill cut it: neither the text the client had twice (llama-server
    # streams the prefill back) nor another rest.
    assert text_of(got, chat=True) == whole
