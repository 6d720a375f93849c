"""A routed request once admitted, as every step after admission carries it: its key, body,
deployment and span, its tokens reserved, and what became of it on the express lane before
the ASGI path took it over."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import ApiKey

from .adapters import AdapterIndex
from .answer import Answer, UpstreamError
from .budgets import Reservation
from .engine_view import EnginePrompt


@dataclass(slots=True)
class Routed:
    """A routed request admitted (its key, body and deployment known, counted, its span begun),
    and what became of it on the express lane before it was handed to the ASGI path."""

    payload: dict[str, Any]
    body: bytes
    model: str
    deployment: str
    key: ApiKey
    span: trace.Span
    arrived: float
    # Its headers as replicas get them (the hop-by-hop ones out, the trace's in).
    headers: list[tuple[bytes, bytes]]
    # The prompt's leading blocks, hashed once for every attempt.
    blocks: Sequence[int]
    # Its tokens held against the key's tpm until its answer ends, and what it was judged to
    # spend: settled with what the answer spent, once (given back where none came).
    reservation: Reservation
    # A streamed answer's usage chunk is taken out: the client did not ask for it.
    strip: bool = False
    # The replica the lane chose (counted as chosen), or None: none could take the request.
    chosen: tuple[str, ReplicaRecord] | None = None
    # What came of sending it there: the answer (its status line in) or the failure before
    # it; None where the lane did not send it (the replica's model name or an idle
    # connection to it was wanting).
    sent: Answer | UpstreamError | None = None
    # The lane decided what comes of the answer (it is past the lane's watch).
    decided: bool = False
    # The deadline of the next read of an answer the lane waits for whole (`express.waits_whole`).
    wait: asyncio.TimerHandle | None = None
    # The LoRA adapter asked for ("" for the base), and the index that says each replica's
    # adapters: a replica with any is sent the `lora` field (adapters.py).
    adapter: str = ""
    adapters: AdapterIndex | None = None
    # The prompt's token blocks as its deployment's engines cut them (`engine_tokens.py`), for
    # replicas whose engine says what it holds; None: not tokenized (routed by `blocks`).
    engine: EnginePrompt | None = None
