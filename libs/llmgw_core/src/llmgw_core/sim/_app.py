from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import web
from ..web import json_response
from . import _kv
from ._body import json_object
from ._lora import Loras
from ._words import _continued, _text, _tokens

if TYPE_CHECKING:
    from collections.abc import Iterator


# The error body of an engine whose GPU faulted (`--fail-completions-after`).
CUDA_FAULT = {
    "message": "CUDA error: an illegal memory access was encountered",
    "type": "InternalServerError",
    "code": 500,
}

# Floats in each embedding.
EMBEDDING_DIM = 16


@dataclass(frozen=True)
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim"
    load_time: float = 0.0
    tokens_per_second: float = 200.0
    exit_after: float | None = None
    exit_code: int = 1
    fail_health_after: float | None = None
    refuse: str | None = None
    rank: int = 0
    world: int = 1
    dist_port: int = 0
    leader: str = ""
    listen_after: float = 0.0
    # Tokens of KV cache: what the kv-cache-usage gauge is a fraction of.
    kv_tokens: int = 4096
    # Exit abruptly after sending this many chunks of a streamed answer, or pieces of the body of
    # one not streamed (0: on reading a request, before any byte of answer), as an engine that
    # crashes mid-request.
    die_after_chunks: int | None = None
    # After this many chunks of a streamed answer, an error event and [DONE] instead of the rest,
    # as vLLM ends a stream whose generation failed.
    error_after_chunks: int | None = None
    # Enter this cgroup (its directory) before serving, as a wrapper that enters one would.
    enter_cgroup: str = ""
    # Once this path exists, take this many MiB of memory and hold them, as an engine whose
    # memory grows past what its machine or cgroup allows.
    allocate_mb: int = 0
    allocate_when: str = ""
    # After this many seconds every completion and chat answer is a 500 while /health still
    # answers 200: a GPU in a bad state (an illegal memory access) that only requests reveal.
    fail_completions_after: float | None = None
    # LoRA adapters loaded at run time (`_lora`): as vLLM's, this many in one batch (0: LoRA
    # off; a load is not refused for the number loaded), of at most this rank, each load taking
    # this many seconds.
    max_loras: int = 0
    max_lora_rank: int = 64
    lora_load_time: float = 0.0
    # Its prompt cache, tokenizer and vLLM's KV events (`_kv`).
    kv_events_config: str = ""
    enable_prefix_caching: bool = False
    kv_blocks: int = 256
    tokenize_delay: float = 0.0


def parse_args(argv: list[str]) -> SimOptions:
    p = argparse.ArgumentParser(prog="llmgw-sim", description="llmgw's simulated inference engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="sim")
    p.add_argument("--load-time", type=float, default=0.0, help="seconds /health answers 503")
    p.add_argument("--tokens-per-second", type=float, default=200.0)
    p.add_argument("--exit-after", type=float, default=None, help="exit after N seconds")
    p.add_argument("--exit-code", type=int, default=1, help="code for --exit-after")
    p.add_argument("--fail-health-after", type=float, default=None)
    p.add_argument("--refuse", default=None, help="refuse to start with this message")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--dist-port", type=int, default=0, help="rank 0: port the workers join")
    p.add_argument("--leader", default="", help="ranks above 0: leader host:port to join")
    p.add_argument(
        "--listen-after",
        type=float,
        default=0.0,
        help="seconds before the port is bound (an engine that loads its weights first)",
    )
    p.add_argument("--kv-tokens", type=int, default=4096, help="KV cache size, in tokens")
    p.add_argument(
        "--die-after-chunks",
        type=int,
        default=None,
        help="exit at once after N chunks of a streamed answer, or N pieces of one not streamed "
        "(0: before answering a request)",
    )
    p.add_argument(
        "--error-after-chunks",
        type=int,
        default=None,
        help="end a streamed answer with an error event after N chunks (the engine gave up on it)",
    )
    p.add_argument("--enter-cgroup", default="", help="a cgroup directory to enter before serving")
    p.add_argument("--allocate-mb", type=int, default=0, help="MiB to take and hold (see --allocate-when)")
    p.add_argument("--allocate-when", default="", help="take --allocate-mb once this path exists")
    p.add_argument(
        "--fail-completions-after",
        type=float,
        default=None,
        help="after N seconds answer every completion 500 (a CUDA error) while /health stays 200",
    )
    p.add_argument("--max-loras", type=int, default=0, help="LoRA adapters in one batch (0: LoRA off)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank loaded")
    p.add_argument("--lora-load-time", type=float, default=0.0, help="seconds each adapter load takes")
    _kv.add_args(p)
    ns = p.parse_args(argv)
    return SimOptions(**vars(ns))


class SimEngine:
    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.started = time.monotonic()
        self.requests = 0
        self.tokens = 0
        # Requests being generated now, and the tokens they hold in the KV cache.
        self.running = 0
        self.kv_used = 0
        # Built at the first scrape: prometheus_client is imported then, not before the engine
        # answers /health (its import is a third of the engine's start).
        self._registry: Any = None
        self.loras = Loras(opts.max_loras, opts.max_lora_rank, opts.lora_load_time)
        self.kv = _kv.Routes(opts.kv_events_config, opts.kv_blocks, opts.tokenize_delay, opts.kv_tokens)

    def _age(self) -> float:
        return time.monotonic() - self.started

    def loading(self) -> bool:
        return self._age() < self.opts.load_time

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health),
                Route("/metrics", self.metrics),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/load_lora_adapter", self.loras.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.loras.unload, methods=["POST"]),
                Route("/tokenize", self.kv.tokenize, methods=["POST"]),
                Route("/reset_prefix_cache", self.kv.reset, methods=["POST"]),
            ],
            exception_handlers={404: _no_route, 405: _no_route},
            max_body_size=web.MAX_BODY,
        )

    async def health(self, _: Request) -> Response:
        if self.loading():
            return json_response({"status": "loading"}, 503)
        fail = self.opts.fail_health_after
        if fail is not None and self._age() >= fail:
            return json_response({"status": "unhealthy"}, 503)
        return json_response({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        from ..metrics import exposition

        if self._registry is None:
            self._registry = self._new_registry()
        return exposition(self._registry, request)

    def _new_registry(self) -> Any:
        """The engine's own registry (tests run several engines in one process)."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

        engine = self

        class Collector:
            def collect(self) -> Iterator[Metric]:
                requests, tokens, loading = engine.requests, engine.tokens, engine.loading()
                yield CounterMetricFamily("llmgw_sim_requests", "Completion requests served.", requests)
                yield CounterMetricFamily("llmgw_sim_generation_tokens", "Tokens generated.", tokens)
                yield GaugeMetricFamily("llmgw_sim_loading", "1 while the model is loading.", loading)
                # As vLLM and llama.cpp report their load: what the launcher reads.
                yield GaugeMetricFamily(
                    "llmgw_sim_requests_running", "Requests being generated now.", engine.running
                )
                yield GaugeMetricFamily(
                    "llmgw_sim_requests_waiting", "Requests queued (the simulator queues none).", 0
                )
                yield GaugeMetricFamily(
                    "llmgw_sim_kv_cache_usage_ratio",
                    "Fraction of the KV cache in use (1 is full).",
                    min(1.0, engine.kv_used / max(1, engine.opts.kv_tokens)),
                )
                if engine.opts.max_loras > 0:
                    # As vLLM's `vllm:lora_requests_info`: set to the time, labelled with the
                    # adapters in use (what the launcher keeps from unloading).
                    info = engine.loras.requests_info()
                    lora = GaugeMetricFamily(
                        "llmgw_sim_lora_requests_info", "Running stats on lora requests.", labels=list(info)
                    )
                    lora.add_metric(list(info.values()), time.time())
                    yield lora

        registry = CollectorRegistry()
        registry.register(Collector())
        return registry

    async def models(self, _: Request) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.opts.model, "object": "model", "owned_by": "llmgw-sim"},
                    *self.loras.models(self.opts.model),
                ],
            }
        )

    async def chat(self, req: Request) -> Response:
        return await self._completion(req, chat=True)

    async def completions(self, req: Request) -> Response:
        return await self._completion(req, chat=False)

    async def _json_body(self, req: Request) -> dict[str, Any] | Response:
        if self.loading():
            return json_response({"error": {"message": "model is loading"}}, 503)
        body = await json_object(req)
        if isinstance(body, str):
            return json_response({"error": {"message": body}}, 400)
        if self.opts.die_after_chunks == 0:
            _die("before answering a request")
        return body

    async def _completion(self, req: Request, chat: bool) -> Response:
        body = await self._json_body(req)
        if isinstance(body, Response):
            return body
        broken = self.opts.fail_completions_after
        if broken is not None and self._age() >= broken:
            # As vLLM answers once CUDA faulted: streamed or not, the request is answered 500.
            return json_response({"error": CUDA_FAULT}, 500)
        return self._complete(body, chat=chat)

    async def embeddings(self, req: Request) -> Response:
        """OpenAI's embeddings: a deterministic unit-free vector per input, as floats or base64."""
        body = await self._json_body(req)
        if isinstance(body, Response):
            return body
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
            return json_response({"error": {"message": "input must be a string or a list of strings"}}, 400)
        data = []
        for i, text in enumerate(inputs):
            digest = hashlib.sha256(text.encode()).digest()
            vector = [(b - 128) / 128 for b in digest[:EMBEDDING_DIM]]
            value: object = vector
            if body.get("encoding_format") == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(x.split()) for x in inputs)
        self.requests += 1
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": self.opts.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def messages(self, req: Request) -> Response:
        """Anthropic's Messages API, not streamed."""
        body = await self._json_body(req)
        if isinstance(body, Response):
            return body
        prompt = json.dumps(body.get("messages") or [], sort_keys=True)
        raw_max = body.get("max_tokens")
        if not isinstance(raw_max, int) or raw_max < 1:
            return json_response(
                {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "max_tokens: required"},
                },
                400,
            )
        words = _tokens(prompt, min(raw_max, 4096))
        self.requests += 1
        self.tokens += len(words)
        return json_response(
            {
                "id": "msg_" + hashlib.sha256(prompt.encode()).hexdigest()[:12],
                "type": "message",
                "role": "assistant",
                "model": self.opts.model,
                "content": [{"type": "text", "text": " ".join(words)}],
                "stop_reason": "max_tokens",
                "stop_sequence": None,
                "usage": {"input_tokens": len(prompt.split()), "output_tokens": len(words)},
            }
        )

    def _complete(self, body: dict[str, object], chat: bool) -> Response:
        self.kv.answered(body, chat, self.loras.loaded)
        # `start`: words of the answer already given, where the request continues it (vLLM's
        # `continue_final_message` for chat; for completions, a prompt ending with them).
        start = 0
        if chat:
            messages = body.get("messages") or []
            last = messages[-1] if isinstance(messages, list) and messages else None
            content = last.get("content") if isinstance(last, dict) else None
            if (
                body.get("continue_final_message") is True
                and isinstance(messages, list)
                and isinstance(last, dict)
                and last.get("role") == "assistant"
                and isinstance(content, str)
            ):
                messages, start = messages[:-1], len(content.split())
            prompt = json.dumps(messages, sort_keys=True)
        else:
            prompt, start = _continued(str(body.get("prompt", "")))
        raw_max = body.get("max_tokens", 16)
        n = raw_max if isinstance(raw_max, int) and raw_max > 0 else 16
        words = _tokens(self.loras.salted(body, prompt), min(n, 4096), start)
        self.requests += 1
        self.tokens += len(words)
        created = int(time.time())
        rid = "cmpl-" + hashlib.sha256((f"{prompt}\n{start}" if start else prompt).encode()).hexdigest()[:12]
        kind = "chat.completion" if chat else "text_completion"
        # A continuation's prompt holds the words already given, as an engine's would.
        usage = {"prompt_tokens": len(prompt.split()) + start, "completion_tokens": len(words)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream"):
            options = body.get("stream_options")
            # As vLLM and OpenAI do: a last chunk with the usage and no choices, when asked.
            last = usage if isinstance(options, dict) and options.get("include_usage") is True else None
            # As the engines send it: no charset parameter, no caching on the way.
            return StreamingResponse(
                self._stream(rid, created, words, chat, last, start, self.loras.adapter(body)),
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
        text = _text(words, start)
        choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answer = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.opts.model,
            "choices": [choice],
            "usage": usage,
        }
        if self.opts.die_after_chunks:
            # Its head and the first pieces of its body, then gone: an engine that crashes while
            # it writes an answer not streamed.
            return StreamingResponse(
                self._pieces(json.dumps(answer).encode(), self.opts.die_after_chunks),
                headers={"Content-Type": "application/json"},
            )
        return json_response(answer)

    async def _pieces(self, body: bytes, pieces: int) -> AsyncIterator[bytes]:
        size = max(1, len(body) // (pieces + 1))
        for at in range(0, size * pieces, size):
            yield body[at : at + size]
            await anyio.sleep(0.01)
        _die(f"after {pieces} pieces of an answer")

    async def _stream(
        self,
        rid: str,
        created: int,
        words: list[str],
        chat: bool,
        usage: dict[str, int] | None = None,
        start: int = 0,
        adapter: str = "",
    ) -> AsyncIterator[bytes]:
        self.running += 1
        self.loras.began(adapter)
        held = 0  # each chunk sent stands for a token held in the cache until the request ends
        try:
            async for chunk in self._chunks(rid, created, words, chat, usage, start):
                if held == self.opts.die_after_chunks:
                    _die(f"after {held} chunks of an answer")
                if held == self.opts.error_after_chunks:
                    error = {"message": "generation failed", "type": "InternalServerError", "code": 500}
                    yield b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"
                    return
                held += 1
                self.kv_used += 1
                yield chunk
        finally:
            self.running -= 1
            self.loras.ended(adapter)
            self.kv_used -= held

    async def _chunks(
        self,
        rid: str,
        created: int,
        words: list[str],
        chat: bool,
        usage: dict[str, int] | None = None,
        start: int = 0,
    ) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        delay = 1.0 / self.opts.tokens_per_second if self.opts.tokens_per_second > 0 else 0.0
        for i, word in enumerate(words):
            piece = _text([word], start + i)
            choice: dict[str, object] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": piece} if i else {"role": "assistant", "content": piece}
            else:
                choice["text"] = piece
            chunk = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.opts.model,
                "choices": [choice],
            }
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await anyio.sleep(delay)
        end: dict[str, object] = {"index": 0, "finish_reason": "length"}
        if chat:
            end["delta"] = {}
        else:
            end["text"] = ""
        final = {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.opts.model,
            "choices": [end],
        }
        yield b"data: " + json.dumps(final).encode() + b"\n\n"
        if usage is not None:
            last = {**final, "choices": [], "usage": usage}
            yield b"data: " + json.dumps(last).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def _die(when: str) -> None:
    print(f"llmgw-sim: dying {when} (--die-after-chunks)", flush=True)
    os._exit(3)


async def _no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return json_response({"error": {"message": f"use POST for {request.url.path}"}}, 405)
    return json_response({"error": {"message": f"no route {request.url.path}"}}, 404)


async def _hold_workers(host: str, port: int, task_status: anyio.abc.TaskStatus[None]) -> None:
    """Rank 0's rendezvous port: workers connect and stay connected, like a Ray head."""

    async def on_worker(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                while await stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return

    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        task_status.started()
        await listener.serve(on_worker)


async def _worker(leader: str) -> int:
    host, _, port = leader.rpartition(":")
    stream = await anyio.connect_tcp(host, int(port))
    print(f"llmgw-sim worker: joined leader {leader}", flush=True)
    async with stream:
        try:
            while True:
                await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            print(f"llmgw-sim worker: lost leader {leader}", flush=True)
            return 1


async def _allocate(mib: int, when: str) -> None:
    while when and not os.path.exists(when):
        await anyio.sleep(0.05)
    print(f"llmgw-sim: taking {mib} MiB", flush=True)
    held = [b"\x01" * (1 << 20) for _ in range(mib)]  # written, so every page is resident
    await anyio.sleep_forever()
    del held


async def run(opts: SimOptions) -> int:
    if opts.refuse:
        print(f"llmgw-sim: refusing to start: {opts.refuse}", file=sys.stderr, flush=True)
        return 2
    code = 0
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    print(f"llmgw-sim: {signal.Signals(signum).name}, shutting down", flush=True)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        if opts.rank > 0:
            code = await _worker(opts.leader)
            tg.cancel_scope.cancel()
            return code
        engine = SimEngine(opts)
        if opts.enter_cgroup:
            Path(opts.enter_cgroup, "cgroup.procs").write_text(str(os.getpid()))
        if opts.allocate_mb:
            tg.start_soon(_allocate, opts.allocate_mb, opts.allocate_when)
        if opts.listen_after > 0:
            await anyio.sleep(opts.listen_after)
        if opts.world > 1:
            await tg.start(_hold_workers, opts.host, opts.dist_port)
        port = await tg.start(web.serve, engine.app(), opts.host, opts.port)
        print(
            f"llmgw-sim: serving {opts.model} on http://{opts.host}:{port} (loading for {opts.load_time}s)",
            flush=True,
        )
        if opts.exit_after is not None:
            await anyio.sleep(opts.exit_after)
            print(
                f"llmgw-sim: exiting with code {opts.exit_code} after {opts.exit_after}s",
                flush=True,
            )
            code = opts.exit_code
            tg.cancel_scope.cancel()
    return code


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    return anyio.run(run, opts)
