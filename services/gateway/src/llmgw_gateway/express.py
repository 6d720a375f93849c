"""The express lane: a routed POST whose body is in, taken from the HTTP protocol's
callbacks where it needs no wait: no task, no ASGI messages, the answer written whole as it
comes. It is admitted as the ASGI path admits (`admission.admit`); any request the lane
cannot finish goes on from where it stands on the ASGI path (`Routed` in the scope under
`RESUMED`), before any byte went to the client: its attempt there, sent or not, is the first
of the ASGI path's attempts, through `LaneTaken`, a transport."""

from __future__ import annotations

import json
import time

import anyio
from opentelemetry import trace

from llmgw_core.events import ReplicaRecord

from .admission import Admitted, Tables, admit
from .budgets import Budgets
from .lane import Lane
from .ledger import Ledger
from .names import ServedNames
from .relay import Relays
from .routed import Routed
from .routing import Table, prompt_blocks
from .surface import HOP_OUT_BYTES, NO_BODY, NONE
from .tracing import chose, replica_headers, served_by, server_span
from .upstream import HIGH_WATER, Answer, Upstream, UpstreamError


class LaneTaken:
    """The transport of the attempt the express lane made before it handed the request over:
    what came of it, its answer (the status line in) or the failure before it."""

    __slots__ = ("sent",)

    def __init__(self, sent: Answer | UpstreamError) -> None:
        self.sent = sent

    async def send(self, method: str, record: ReplicaRecord, path: str, routed: Routed) -> Answer:
        if not isinstance(self.sent, Answer):
            raise self.sent
        return self.sent


class ExpressLane:
    """Takes what it can of the routed requests from the HTTP protocol's callbacks."""

    __slots__ = ("budgets", "ledger", "loaded", "names", "relays", "table", "tables", "tracer", "upstream")

    def __init__(
        self,
        tables: Tables,
        loaded: anyio.Event,
        budgets: Budgets,
        tracer: trace.Tracer,
        ledger: Ledger,
        names: ServedNames,
        upstream: Upstream,
        relays: Relays,
    ) -> None:
        self.tables = tables
        self.table: Table = tables.table
        self.loaded = loaded
        self.budgets = budgets
        self.tracer = tracer
        self.ledger = ledger
        self.names = names
        self.upstream = upstream
        self.relays = relays

    def express(self, lane: Lane) -> bool:
        """Take a routed POST whose body is in. False, with nothing done, where the request
        needs the ASGI path from its start (a key or the buckets to wait for, a limit to claim
        on the bus, an answer to stream, an error to answer): it goes there. Once taken it is
        counted, and what cannot be finished here (no replica to take it, its model name or an
        idle connection to it wanting, a failure, an answer streamed or of no given length)
        goes on from where it stands on the ASGI path (`Routed` in the scope)."""
        arrived = time.monotonic()
        if not self.loaded.is_set():
            return False
        now = time.time()
        path = lane.path
        admitted = admit(lane.headers, bytes(lane.body), path, self.tables, loaded=True, now=now)
        if not isinstance(admitted, Admitted) or admitted.unserved or admitted.payload.get("stream") is True:
            return False
        # A request to replicas with LoRA adapters names their scales (attempts.Replicas.send).
        if admitted.adapter or self.table.adapters.any_on(admitted.deployment):
            return False
        # Its engines say what they hold: its tokens are asked first (engine_tokens.py).
        if self.table.viewed(admitted.deployment):
            return False
        key, payload, body, model, deployment = admitted[:5]
        reservation = self.budgets.reserve_at_once(key, admitted.estimate, now)
        if reservation is None:
            return False
        blocks = prompt_blocks(self.table.routing, deployment, path, payload)
        # Taken: counted once the request is on its way to a replica, or handed over.
        span = server_span(self.tracer, lane.scope, model, deployment)
        headers = replica_headers(lane.headers, span)
        routed = Routed(payload, body, model, deployment, key, span, arrived, headers, blocks, reservation)
        chosen = routed.chosen = self.table.pick(deployment, NONE, routed.blocks)
        if chosen is not None:
            chose(span, self.table.reason)
        served = None if chosen is None else self.names.known(chosen[1])
        if chosen is None or served is None:
            self.ledger.arrived(deployment)
            lane.hand_over(routed)
            return True
        chosen_key, record = chosen
        content = body if served == model else json.dumps({**payload, "model": served}).encode()

        def watch() -> None:
            # After a read of the replica's bytes, or a failure: from the status line on, the
            # lane decides (`answer`).
            answer = routed.sent
            if isinstance(answer, Answer) and not routed.decided and answer.head_in:
                self.answer(lane, routed)

        answer = self.upstream.send_idle("POST", record.url, path, content, routed.headers, watch, lane.loop)
        self.ledger.arrived(deployment)
        if answer is None:
            lane.hand_over(routed)
            return True
        self.ledger.in_flight(chosen_key, record, deployment, span)
        routed.sent = answer
        return True

    def answer(self, lane: Lane, routed: Routed) -> None:
        """What comes of the answer to a request the lane sent, from its status line on:
        written here once whole where its length is given (`waits_whole`), else the request
        goes on on the ASGI path (a failure before the answer retried there, after it cut off
        there, any other answer passed on in pieces)."""
        if routed.decided:
            return
        answer = routed.sent
        assert isinstance(answer, Answer)
        assert routed.chosen is not None
        if routed.wait is not None:
            routed.wait.cancel()
            routed.wait = None
        if not answer.complete and not answer.failed and waits_whole(answer):
            # Its body comes in reads after its head's (engines served by uvicorn write the two
            # apart): waited for here, each read within the read timeout as on the ASGI path.
            timeout = self.upstream.read_timeout_s
            if timeout is not None:
                routed.wait = lane.loop.call_later(timeout, answer.time_out)
            return
        routed.decided = True
        answer.unwatch()
        failure = answer.failed_before_answer
        if failure is not None:
            answer.release()
            routed.sent = failure
            lane.hand_over(routed)
            return
        status = answer.status
        if (
            not answer.complete
            or status < 200
            or status in NO_BODY
            or answer.header(b"content-type").startswith("text/event-stream")
        ):
            lane.hand_over(routed)
            return
        first_byte = time.monotonic()
        headers = [(n, v) for n, v in ((n.lower(), v) for n, v in answer.headers) if n not in HOP_OUT_BYTES]
        body = answer.body()
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append(served_by(routed.deployment, routed.chosen[0]))

        def count() -> None:
            # After the answer is written: the client waits on none of it.
            chosen_key, deployment = routed.chosen[0], routed.deployment  # type: ignore[index]
            self.ledger.answered(routed.span, deployment, status)
            self.relays.count_whole(answer, body, chosen_key, deployment, routed, first_byte)

        lane.answer(status, headers, body, count)


def waits_whole(answer: Answer) -> bool:
    """Whether the express lane waits for the rest of an answer whose status line is in: a
    final answer, not server-sent events, whose body's length is given and within what is read
    ahead of a client. Any other goes on from the ASGI path, passed on as it comes."""
    status = answer.status
    if status < 200 or status in NO_BODY or answer.header(b"content-type").startswith("text/event-stream"):
        return False
    length = answer.header(b"content-length")
    return length.isdigit() and int(length) <= HIGH_WATER
