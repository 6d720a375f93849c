"""The attempts of one routed request: a replica picked (or the request held for one), the
request sent there through a transport, and, where the replica failed before any byte of
answer (it refused the connection, or closed or reset it before answering: it died, and
placement has not said so yet), another attempt, on the same replica once where it closed a
pooled connection, else on another. The first answer that begins goes to the relay; a failure
after it began is the replica's: never retried, but continued (`continuation.py`): a
stream on another replica from what its client has (`Relays.relay`, `resend`), an answer not
streamed (read whole before any of it is passed on: `read`) sent again whole to another.

A transport sends one attempt: `Replicas` sends it to the replica's engine, by its served
name; the express lane's is the attempt it made itself before it handed the request over
(`express.LaneTaken`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Protocol

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmgw_core.events import ReplicaRecord
from llmgw_core.subjects import Names

from .admission import unserved_by
from .continuation import CONTINUED_PATHS, MAX_HELD_BYTES, ContinuationError
from .engine_tokens import EngineTokens
from .errors import error
from .ledger import Ledger
from .metrics import Metrics
from .names import ServedNames
from .pick import Picker, Tries
from .relay import Relays
from .routed import Routed
from .upstream import FAILED, REFUSED, Answer, Upstream, before_answer

log = logging.getLogger("llmgw.gateway")


class Transport(Protocol):
    """What sends one attempt of a request to a replica and gives back its answer, the status
    line in; a failure raises one of `upstream.FAILED`."""

    async def send(self, method: str, record: ReplicaRecord, path: str, routed: Routed) -> Answer: ...


class Replicas:
    """The transport to replicas' engines: the request sent by the model name the replica's
    engine answers to (its body rewritten where that is not the name the client used)."""

    __slots__ = ("names", "upstream")

    def __init__(self, names: ServedNames, upstream: Upstream) -> None:
        self.names = names
        self.upstream = upstream

    async def send(self, method: str, record: ReplicaRecord, path: str, routed: Routed) -> Answer:
        served = await self.names.of(record)
        content = routed.body
        lora = None
        if routed.adapters is not None:
            replica = Names.replica_key(record.deployment, record.replica)
            if routed.adapter and routed.adapters.runtime(replica):
                # vLLM selects a loaded adapter by its name as `model`: the body goes as it came.
                routed.adapters.used(replica, routed.adapter)
                return await self.upstream.request(method, record.url, path, content, routed.headers)
            lora = routed.adapters.lora(replica, routed.adapter)
        if lora is not None:
            content = json.dumps({**routed.payload, "model": served or routed.model, "lora": lora}).encode()
        elif served is not None and served != routed.model:
            content = json.dumps({**routed.payload, "model": served}).encode()
        return await self.upstream.request(method, record.url, path, content, routed.headers)


class Attempts:
    """Sends a request until a replica's answer begins, or answers it where none will."""

    __slots__ = ("ledger", "metrics", "names", "picker", "relays", "replicas", "tokens")

    def __init__(
        self,
        picker: Picker,
        replicas: Replicas,
        relays: Relays,
        ledger: Ledger,
        metrics: Metrics,
        tokens: EngineTokens | None = None,
    ) -> None:
        self.picker = picker
        # The request's tokens from its engine, where its deployment's engines say what they
        # hold (engine_tokens.py); None: routed by the text index alone.
        self.tokens = tokens
        self.replicas = replicas
        self.names = replicas.names
        self.relays = relays
        self.ledger = ledger
        self.metrics = metrics
        relays.resend = self.resend

    async def forward(
        self, request: Request, routed: Routed, unserved: frozenset[str], taken: Transport | None = None
    ) -> Response:
        """The client's response: the replica's answer, or the gateway's own error. `taken`:
        the express lane sent the request to `routed.chosen` already (and counted it there)."""
        path: str = request.scope["path"]
        deployment, span = routed.deployment, routed.span
        tries = Tries(unserved)
        if taken is None and routed.chosen is None and self.tokens is not None:
            # Before the pick: a deployment whose engines say what they hold is matched by the
            # prompt's tokens (nothing is asked of any other deployment's engines).
            routed.engine = await self.tokens.prompt(routed, path)
        # Answers not streamed that broke off before any of them was passed on, each sent again.
        resent = 0
        if routed.chosen is not None and taken is None:
            # The lane chose a replica but could not send to it: asked first.
            tries.again = routed.chosen
        while True:
            transport: Transport
            if taken is not None and routed.chosen is not None:
                chosen, transport, taken = routed.chosen, taken, None
            else:
                picked = await self.picker.pick(request, routed, tries)
                if isinstance(picked, JSONResponse):
                    return picked
                chosen, transport = picked, self.replicas
                # Counted at once, before any await: requests arriving together must see each other.
                self.ledger.in_flight(chosen[0], chosen[1], deployment, span)
            chosen_key, record = chosen
            tries.tried.add(chosen_key)
            try:
                answer = await transport.send(request.method, record, path, routed)
            except FAILED as exc:
                self.ledger.release(chosen_key, deployment)
                if not before_answer(exc):
                    self._judged(chosen_key, exc)
                    return self._failed(record, deployment, span, exc)
                # No byte of answer came: the replica refused the connection, or closed or reset
                # it before answering (it died with the request). Another one may take it.
                refused = isinstance(exc, REFUSED)
                self.metrics.errors.labels(deployment, "connect" if refused else "reset").inc()
                if not refused and chosen_key not in tries.reconnected:
                    tries.reconnected.add(chosen_key)
                    tries.again = chosen
                    log.info(
                        "%s: %s closed the connection before answering (%s); asking it again",
                        deployment,
                        chosen_key,
                        exc,
                    )
                    continue
                self._judged(chosen_key, exc)
                self.names.forget(record)
                tries.failures.append(f"{record.replica} at {record.url}: {exc or type(exc).__name__}")
                what = "refused the connection" if refused else "failed before answering"
                log.warning("%s: %s %s (%s); trying another", deployment, chosen_key, what, exc)
                continue
            except BaseException:
                self.ledger.release(chosen_key, deployment)
                raise
            read: bytes | None = None
            if self._reads_first(answer, path):
                try:
                    read = await self.read(answer)
                except FAILED as exc:
                    # Broken off before any byte of it was passed on: the client has nothing
                    # of it, so another replica is asked for all of it.
                    answer.release()
                    self.ledger.release(chosen_key, deployment)
                    self._judged(chosen_key, exc)
                    self.metrics.errors.labels(deployment, "upstream").inc()
                    resent += 1
                    if resent > self.picker.table.routing.continuations:
                        return self._failed(record, deployment, span, exc)
                    tries.failures.append(
                        f"{record.replica} at {record.url} broke off its answer: {exc or type(exc).__name__}"
                    )
                    log.warning(
                        "%s: %s broke off its answer (%s); asking another", deployment, chosen_key, exc
                    )
                    continue
            return self.relays.response(answer, chosen_key, routed, path, read)

    def _reads_first(self, answer: Answer, path: str) -> bool:
        """Whether an answer is read (up to MAX_HELD_BYTES) before any of it is passed on, so
        that one broken off can be asked of another replica: a chat or completion answer not
        streamed, not in whole with its head, where answers are continued."""
        return (
            path in CONTINUED_PATHS
            and answer.status == 200
            and not answer.complete
            and self.relays.continues()
            and not answer.header(b"content-type").startswith("text/event-stream")
        )

    async def read(self, answer: Answer) -> bytes:
        """An answer's body, read to its end or past MAX_HELD_BYTES (the rest is passed on as
        it comes); raises one of FAILED where the replica breaks it off."""
        parts: list[bytes] = []
        size = 0
        async for chunk in answer.chunks():
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_HELD_BYTES:
                break
        return b"".join(parts)

    async def resend(
        self,
        routed: Routed,
        routed_for: Callable[[ReplicaRecord], Routed],
        path: str,
        broken: frozenset[str],
        fingerprint: str,
    ) -> tuple[str, Answer] | str:
        """The rest of a streamed answer asked of a ready replica of its deployment, neither one
        in `broken` nor one whose engine does not serve `path`, of profile fingerprint
        `fingerprint` (the same model and weights: another's tokens would not continue the
        text), with the request `routed_for` builds for that replica's engine: its key and its
        streamed answer, counted in flight; or why no replica took it."""
        table, deployment, span = self.picker.table, routed.deployment, routed.span
        excluded = set(broken) | unserved_by(table, self.picker.engines, deployment, path)
        # Mid-rollout a deployment has replicas of two profiles: only the same one continues.
        other = {k for k, r in table.of(deployment) if r.profile_fp != fingerprint and k not in excluded}
        excluded |= other
        failures: list[str] = []
        while (
            chosen := table.pick(deployment, frozenset(excluded), routed.blocks, routed.engine)
        ) is not None:
            key, record = chosen
            excluded.add(key)
            try:
                sent = routed_for(record)
            except ContinuationError as exc:
                return str(exc)
            self.ledger.in_flight(key, record, deployment, span)
            try:
                answer = await self.replicas.send("POST", record, path, sent)
            except FAILED as exc:
                self.ledger.release(key, deployment)
                self._judged(key, exc)
                failures.append(f"{record.replica} at {record.url}: {exc or type(exc).__name__}")
                continue
            except BaseException:
                self.ledger.release(key, deployment)
                raise
            if answer.status == 200 and answer.header(b"content-type").startswith("text/event-stream"):
                table.outcome(key, 200)
                return key, answer
            answer.release()
            self.ledger.release(key, deployment)
            table.outcome(key, answer.status)
            failures.append(f"{record.replica} at {record.url} answered {answer.status}")
        if failures:
            return "; ".join(failures)
        ready = sorted(table.replicas[k].replica for k in other if table.replicas[k].state == "ready")
        if ready:
            return (
                f"deployment {deployment} has no other ready replica of the same model and weights "
                f"(profile fingerprint {fingerprint}): {', '.join(ready)} of another profile cannot "
                "continue it"
            )
        return f"deployment {deployment} has no other ready replica"

    def _judged(self, key: str, exc: BaseException) -> None:
        """No answer came from the replica (a pooled connection it closed as the request came is
        not counted: llama-server closes one after each streamed answer): its failure, for
        outlier detection."""
        self.picker.table.outcome(key, 0, str(exc) or type(exc).__name__)

    def _failed(
        self, record: ReplicaRecord, deployment: str, span: trace.Span, exc: BaseException
    ) -> Response:
        """The 502 of a replica that failed after it had the request: never retried."""
        self.metrics.errors.labels(deployment, "upstream").inc()
        message = (
            f"replica {record.replica} of deployment {deployment} at {record.url} failed: "
            f"{exc or type(exc).__name__}"
        )
        span.set_attributes({"http.response.status_code": 502, "error.type": "replica_failed"})
        span.set_status(trace.StatusCode.ERROR, message)
        span.end()
        return error(502, message, "upstream_error", "replica_failed")
