"""Pick or hold: the replica a routed request goes to next, or, where none can take it yet
(scaled to zero, starting), the wait for one, bounded by `hold_timeout_s` all told; where
none will, the gateway's answer (422 where placement can place the deployment nowhere, 503
where no replica is ready or every one failed, 429 where the hold queue is full, 401 where
the key was revoked while the request was held)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse

from llmgw_core.engines import Registry
from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import ApiKey

from .admission import unserved_by, unsupported_by
from .demand import DemandCounts
from .errors import error, unplaceable
from .holds import FULL_RETRY_AFTER_S, RESTART_RETRY_AFTER_S, TIMEOUT_RETRY_AFTER_S, Holds
from .keyring import Keyring
from .ledger import Ledger
from .metrics import Metrics
from .routed import Routed
from .routing import Table
from .tracing import chose

Chosen = tuple[str, ReplicaRecord]


@dataclass(slots=True)
class Tries:
    """A request's attempts so far: the replicas not to pick again (those tried, those whose
    engine does not serve the path), why each failed, and the one to ask again first."""

    unserved: frozenset[str]
    tried: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    # A replica that closed a pooled connection as the request came is asked once more, on a
    # connection of its own, before another is: llama-server closes its connection after
    # each streamed answer, and a request sent on it in that instant never reached it.
    # Another replica would have to compute the prompt its cache holds.
    again: Chosen | None = None
    reconnected: set[str] = field(default_factory=set)
    # When the request was first held: its waits, all told, last at most hold_timeout_s.
    held_since: float | None = None

    def __post_init__(self) -> None:
        self.tried = set(self.unserved)


class Picker:
    """Picks a request's replica from the table, holding it where none is ready yet."""

    __slots__ = ("demand", "engines", "holds", "keyring", "ledger", "metrics", "table")

    def __init__(
        self,
        table: Table,
        holds: Holds,
        demand: DemandCounts,
        keyring: Keyring,
        engines: Registry,
        ledger: Ledger,
        metrics: Metrics,
    ) -> None:
        self.table = table
        self.holds = holds
        self.demand = demand
        self.keyring = keyring
        self.engines = engines
        self.ledger = ledger
        self.metrics = metrics

    async def pick(self, request: Request, routed: Routed, tries: Tries) -> Chosen | JSONResponse:
        """The replica the request goes to next (not counted in flight yet), or the answer
        where none will take it."""
        deployment, span = routed.deployment, routed.span
        path: str = request.scope["path"]
        while True:
            again, tries.again = tries.again, None
            if again is not None:
                return again
            chosen = self.table.pick(deployment, frozenset(tries.tried), routed.blocks, routed.engine)
            if chosen is not None:
                chose(span, self.table.reason)
                return chosen
            if not tries.failures and self.holdable(deployment):
                # No replica can take it yet (scaled to zero, starting): held until one is ready.
                since = tries.held_since = time.monotonic() if tries.held_since is None else tries.held_since
                outcome = await self.hold(request, deployment, since + self.holds.timeout_s)
                if outcome != "sent":
                    answer, why = self.held_answer(deployment, outcome, since)
                    return self.ledger.refuse(span, deployment, answer, why)
                # Its key may have been revoked, or have expired, while it was held.
                revoked = self.held_key_refused(routed, since)
                if revoked is not None:
                    return self.ledger.refuse(span, deployment, revoked, "unauthorized")
                # A replica is ready now; it may run an engine that does not serve the path.
                unserved = unserved_by(self.table, self.engines, deployment, path)
                unsupported = unsupported_by(self.table, self.engines, deployment, path, unserved)
                if unsupported is not None:
                    refusal = error(400, unsupported, "invalid_request_error", "unsupported_endpoint")
                    return self.ledger.refuse(span, deployment, refusal, "unsupported_path")
                tries.unserved, tries.tried = unserved, set(unserved)
                continue
            cannot = None if tries.failures else self.table.refused(deployment)
            if cannot is not None:
                return self.ledger.refuse(span, deployment, unplaceable(cannot), "unplaceable")
            if tries.failures:
                attempts = len(tries.tried - tries.unserved)
                plural = "" if attempts == 1 else "s"
                reason = (
                    f"deployment {deployment} has {attempts} ready replica{plural} but none "
                    f"accepted the request: {'; '.join(tries.failures)}"
                )
            else:
                reason = self.table.unavailable(deployment, time.time())
            refusal = error(503, reason, "service_unavailable", "no_ready_replica")
            return self.ledger.refuse(span, deployment, refusal, "no_ready_replica")

    def holdable(self, deployment: str) -> bool:
        """Whether a request for `deployment` with no replica to take it waits for one: it is in
        the deployments bucket, meant to run (an autoscale, or a count above 0) and holding is
        on. A deployment scaled to 0 by hand is answered at once: nothing will start it; so is
        one placement could place on no node, with none of its replicas placed (`Table.refused`):
        nothing can serve it until the cluster changes."""
        d = self.table.deployments.get(deployment)
        return (
            self.holds.enabled
            and d is not None
            and (d.autoscale is not None or d.replicas > 0)
            and self.table.refused(deployment) is None
        )

    async def hold(self, request: Request, deployment: str, deadline: float) -> str:
        """Hold the request until a replica of `deployment` can take it: `sent` (one can now),
        `timeout` (past `deadline`), `full` (the queue is), `left` (the client went),
        `restarting` (the gateway is stopping)."""
        if self.holds.closing:
            return "restarting"
        held = self.holds.add(deployment)
        if held is None:
            return "full"
        if self.holds.queued(deployment) == 1:
            # The deployment's first held request: the autoscaler hears of it now, not at the
            # next report.
            self.demand.wanted.set()
        self.metrics.held.labels(deployment).inc()
        outcome = "timeout"
        try:
            async with anyio.create_task_group() as tg:

                async def client_left() -> None:
                    # The body is in: the next message the server has for this request is the
                    # client's disconnect.
                    nonlocal outcome
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    outcome = "left"
                    tg.cancel_scope.cancel()

                tg.start_soon(client_left)
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    await held.woken.wait()
                    outcome = "restarting" if held.closing else "sent"
                if outcome == "sent":
                    # Its turn among those released together (`Holds.release` paces them),
                    # unless the gateway stops first.
                    with anyio.move_on_after(max(0.0, held.at - time.monotonic())):
                        await held.stopped.wait()
                        outcome = "restarting"
                tg.cancel_scope.cancel()
        finally:
            self.holds.remove(held)
            self.metrics.held.labels(deployment).dec()
            self.metrics.hold_wait.labels(deployment, outcome).observe(time.monotonic() - held.since)
        return outcome

    def held_key_refused(self, routed: Routed, since: float) -> JSONResponse | None:
        """The 401 for a request whose key was revoked, deleted or expired while it was held;
        None where the key is still active."""
        found = self.keyring.recheck(routed.key)
        if isinstance(found, ApiKey):
            return None
        waited = time.monotonic() - since
        return error(
            401,
            f"{found.message} (the request was held {waited:.1f}s for a ready replica of deployment "
            f"{routed.deployment} and was not sent)",
            "authentication_error",
            found.code,
        )

    def replicas_changed(self, deployment: str) -> None:
        """A replica or the deployment changed: held requests go where a replica can take them
        now, and are answered where the deployment is no longer meant to run."""
        can_take = self.table.ready(deployment) or self.table.unknown(deployment)
        if can_take or not self.holdable(deployment):
            self.holds.release(deployment)

    def held_answer(self, deployment: str, outcome: str, since: float) -> tuple[JSONResponse, str]:
        """The answer to a request held and not sent, and its reason for the errors counter."""
        waited = time.monotonic() - since
        if outcome == "full":
            return error(
                429,
                f"deployment {deployment} has no ready replica and {self.holds.limit} requests are "
                f"already held for one (the gateway's hold_queue); retry in {FULL_RETRY_AFTER_S}s",
                "requests",
                "hold_queue_full",
                retry_after=FULL_RETRY_AFTER_S,
            ), "hold_queue_full"
        if outcome == "restarting":
            return error(
                503,
                f"gateway restarting: the request was held {waited:.1f}s for a ready replica of "
                f"deployment {deployment} and was not sent; retry in {RESTART_RETRY_AFTER_S}s",
                "service_unavailable",
                "gateway_restarting",
                retry_after=RESTART_RETRY_AFTER_S,
            ), "gateway_restarting"
        why = "client_left" if outcome == "left" else "no_ready_replica"
        # The replicas' own words (`r0 starting for 38s (loading …)`), or placement's refusal.
        reason = (
            f"{self.table.unavailable(deployment, time.time())}; the request was held "
            f"{waited:.1f}s (the gateway's hold_timeout_s: {self.holds.timeout_s:g}s) and no replica "
            "became ready"
        )
        refusal = error(
            503, reason, "service_unavailable", "no_ready_replica", retry_after=TIMEOUT_RETRY_AFTER_S
        )
        return refusal, why
