"""The gateway service: keep the routing table from the buckets, and serve the proxy.

Stateless: everything it routes by is in the replicas and deployments buckets,
and every client key in the keys bucket, read through KV watches (every key's
value first, then each change; a watch survives NATS restarts). Any number of gateways can run side by side.

Each reports its demand (requests in flight, held and arrived per deployment) on
`<prefix>.demand.<id>` every `demand_interval_s`, and at once when it starts holding a
request for a deployment with no ready replica, for placement's autoscaler to sum; and with
it, on `<prefix>.judgement.<id>`, the replicas failing its requests (`outliers.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import anyio.abc
import httpx
from opentelemetry import trace
from prometheus_client import Info

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import (
    Demand,
    Deployment,
    DeploymentStatus,
    Judgement,
    ReplicaRecord,
    ShardStatus,
    encode,
)
from llmgw_core.keys import ApiKey, KeyWindow
from llmgw_core.limits import key_problem
from llmgw_core.metrics import serve_metrics
from llmgw_core.retry import Retry

from . import worker_metrics
from .adapter_loads import AdapterLoads
from .budgets import Budgets
from .config import GatewayConfig, load_api_keys
from .connections import (
    ACCEPT_BACKLOG,
    Connections,
    HeaderLimits,
    connection_limit,
    open_file_limit,
    protocol,
)
from .demand import default_id
from .holds import Holds
from .keyring import Keyring, file_keys
from .outliers import Outliers
from .prefix_share import PrefixShare
from .proxy import ROUTED, Proxy
from .routing import Table
from .upstream import Upstream
from .web import cors, serve_app

log = logging.getLogger("llmgw.gateway")

# The pause before following a bucket again after a failure, growing to the cap.
RETRY_FIRST_S = 0.5
RETRY_CAP_S = 10.0
# How long a stopping gateway tries to send its last demand report.
LAST_REPORT_S = 1.0


def cut_off(bus: Bus) -> str:
    """What `/healthz` says while this gateway cannot hear NATS ("" while it can)."""
    if bus.connected:
        return ""
    since = time.monotonic() - bus.disconnected_since
    return f"cut off from NATS for {since:.0f} s: serving the replicas it knew then"


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        bus: Bus,
        *,
        tracer: trace.Tracer | None = None,
        reuse_port: bool = False,
        worker: tuple[int, str] | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        # A worker of several on one port (`http: workers`): each binds it with SO_REUSEPORT.
        self.reuse_port = reuse_port
        # (its index, the supervisor's run directory) for a worker of several: its registry is
        # also served on a private port, for the worker a scrape reaches (`worker_metrics`).
        self.worker = worker
        self.table = Table(routing=config.routing, outliers=Outliers(config.outliers))
        # Its name in its demand reports.
        self.id = config.id or default_id()
        # What each replica holds, shared with every gateway through the routing bucket.
        shared = config.routing.shared and config.routing.prefix_aware
        self.share = PrefixShare(bus, self.table, self.id) if shared else None
        http = config.http
        secrets = load_api_keys(http.api_keys_file) if http.api_keys_file else frozenset()
        self.keyring = Keyring(required=http.require_api_key, file=file_keys(secrets))
        self.budgets = Budgets(bus, writer=self.id)
        open_files = open_file_limit()
        limit = connection_limit(http.max_connections, http.reserved_fds, open_files)
        # For a replica's /v1/models, read once per replica.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=config.connect_timeout_s, read=10.0, write=10.0, pool=10.0),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=4),
        )
        # One pool for every replica: kept-alive connections, no per-request handshake. At most
        # one replica connection per client connection (a request holds one at a time), so
        # that the two together stay within the open-file limit.
        self.upstream = Upstream(
            limit=limit,
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s or None,
        )
        self.proxy = Proxy(
            self.table,
            self.client,
            keyring=self.keyring,
            budgets=self.budgets,
            max_body_bytes=config.max_body_bytes,
            max_json_depth=config.max_json_depth,
            tracer=tracer,
            upstream=self.upstream,
            holds=Holds(config.hold_queue, config.hold_timeout_s, config.hold_release_per_s),
            adapter_loads=AdapterLoads(bus, self.table, config.hold_timeout_s),
        )
        # Which gateway answered a scrape: with workers on one port, each has its own counts.
        Info(
            "llmgw_gateway",
            "This gateway process: its id in demand reports.",
            registry=self.proxy.metrics.registry,
        ).info({"id": self.id})
        self.usage = self.proxy.usage
        self.usage.bus = bus
        self.proxy.cut_off = partial(cut_off, bus)
        self.connections = Connections(
            limit,
            header_timeout_s=http.header_timeout_s,
            body_timeout_s=http.body_timeout_s,
            registry=self.proxy.metrics.registry,
            headers=HeaderLimits(
                field_bytes=http.max_header_field_bytes,
                section_bytes=http.max_header_section_bytes,
                fields=http.max_header_fields,
                in_flight_bytes=http.header_bytes_in_flight,
            ),
        )
        log.info(
            "holding up to %d client connections (open-file limit %d, http: reserved_fds %d)",
            limit,
            open_files,
            http.reserved_fds,
        )

    async def _load(self) -> None:
        """The first snapshot, before the gateway answers `unknown model` to anyone."""
        names = self.bus.names
        for key, change in (await self.bus.entries(names.replicas_bucket, ReplicaRecord)).items():
            if await self._acceptable(names.replicas_bucket, key, change.value):
                self.table.set_replica(key, change.value)
        try:
            deployments = await self.bus.entries(names.deployments_bucket, Deployment)
        except BusError as exc:
            log.error(
                "cannot read the deployments bucket (%s): aliases are unknown, and deployments are known "
                "by their replicas only; the gateway identity may read it since this release (llmgw auth "
                "init rewrites auth.conf)",
                exc,
            )
            return
        for key, dchange in deployments.items():
            if await self._acceptable(names.deployments_bucket, key, dchange.value):
                self.table.set_deployment(key, dchange.value)
        await self._load_keys()

    async def _load_keys(self) -> None:
        names = self.bus.names
        try:
            keys = await self.bus.entries(names.keys_bucket, ApiKey)
            windows = await self.bus.entries(names.limits_bucket, KeyWindow)
        except BusError as exc:
            log.error(
                "cannot read the keys or limits bucket (%s): only api_keys_file's keys are known; the "
                "gateway identity may read them since this release (llmgw auth init rewrites auth.conf)",
                exc,
            )
            return
        for name, kchange in keys.items():
            self.keyring.set(name, kchange.value)
        for name, wchange in windows.items():
            self.budgets.observe(name, wchange.value)

    async def _follow_keys(self, retry: Retry) -> None:
        async for change in self.bus.watch(self.bus.names.keys_bucket, ApiKey):
            retry.succeeded()
            self.keyring.set(change.key, change.value)

    async def _follow_limits(self, retry: Retry) -> None:
        async for change in self.bus.watch(self.bus.names.limits_bucket, KeyWindow):
            retry.succeeded()
            self.budgets.observe(change.key, change.value)

    async def _follow_replicas(self, retry: Retry) -> None:
        bucket = self.bus.names.replicas_bucket
        async for change in self.bus.watch(bucket, ReplicaRecord):
            retry.succeeded()
            if await self._acceptable(bucket, change.key, change.value):
                before = self.table.replicas.get(change.key)
                self.table.set_replica(change.key, change.value)
                if self.share is not None and change.value is not None:
                    self.share.state.known(change.key)
                record = change.value or before
                if record is not None:
                    self.proxy.replicas_changed(record.deployment)

    async def _follow_shard_statuses(self, retry: Retry) -> None:
        """Each engine's running and waiting requests, as its launcher last read them: every
        gateway's requests on a replica, weighed against its prefix (`weigh.py`)."""
        async for change in self.bus.watch(self.bus.names.shard_status_bucket, ShardStatus):
            retry.succeeded()
            self.table.set_shard_status(change.key, change.value)

    async def _follow_deployments(self, retry: Retry) -> None:
        bucket = self.bus.names.deployments_bucket
        async for change in self.bus.watch(bucket, Deployment):
            retry.succeeded()
            if await self._acceptable(bucket, change.key, change.value):
                self.table.set_deployment(change.key, change.value)
                self.proxy.replicas_changed(change.key)

    async def _follow_statuses(self, retry: Retry) -> None:
        """Placement's last word on each deployment: why one with no replica is not placed."""
        subject = self.bus.names.deployment_event("*")
        async for _, status in self.bus.last_per_subject(subject, DeploymentStatus):
            retry.succeeded()
            self.table.set_status(status)
            self.proxy.adapter_limits.observe(status.deployment, status.adapter_quotas)
            # Requests held for it are answered at once where placement now says it can place
            # none: nothing will serve them within hold_timeout_s.
            self.proxy.replicas_changed(status.deployment)

    def demand(self) -> Demand:
        """This gateway's demand report now (the arrivals since the last one are reset)."""
        return self.proxy.demand.report(
            self.id,
            self.table.outstanding,
            self.proxy.holds.counts(),
            interval_s=self.config.demand_interval_s,
            at=time.time(),
        )

    async def _report_demand(self) -> None:
        """Publish the demand report every interval, and at once when the proxy asks (its first
        held request for a deployment). Plain NATS: a report lost is replaced by the next."""
        subject = self.bus.names.demand(self.id)
        interval = self.config.demand_interval_s
        failing = False
        while True:
            with anyio.move_on_after(interval):
                await self.proxy.demand.wanted.wait()
            self.proxy.demand.wanted = anyio.Event()
            try:
                await self.bus.publish_core(subject, self.demand())
                judged = self.table.outliers.judgements()
                if judged:
                    # The replicas failing their answers, in their engines' words, for placement.
                    await self.bus.publish_core(
                        self.bus.names.judgement(self.id),
                        Judgement(gateway=self.id, replicas=judged, interval_s=interval, at=time.time()),
                    )
            except BusError as exc:
                if not failing:
                    log.warning("cannot publish demand on %s (retrying each interval): %s", subject, exc)
                failing = True
                continue
            if failing:
                log.info("demand reports on %s are published again", subject)
            failing = False

    async def _answer_held_at_stop(self) -> None:
        """Until the gateway stops; then every held request is answered 503 (`gateway
        restarting`) within the HTTP server's grace, instead of being cut off unanswered, and
        a last report says it holds none (else the autoscaler would count them until it drops
        the silent gateway's report)."""
        try:
            await anyio.sleep_forever()
        finally:
            self.proxy.holds.close()
            if self.proxy.loaded.is_set():
                with anyio.CancelScope(shield=True), anyio.move_on_after(LAST_REPORT_S):
                    try:
                        await self.bus.publish_core(self.bus.names.demand(self.id), self.demand())
                    except BusError as exc:
                        log.warning("cannot publish the last demand report: %s", exc)

    async def _acceptable(self, bucket: str, key: str, value: Deployment | ReplicaRecord | None) -> bool:
        """Whether a key may enter the routing table: one over the name limits or with a dot
        (written by hand) is dead-lettered, and never named to a client as a deployment."""
        if bucket == self.bus.names.replicas_bucket:
            problem = key_problem(key, "deployment", "replica")
        else:
            problem = key_problem(key, "deployment")
        if problem is None:
            return True
        if value is not None:  # a delete of a key never taken changes nothing
            await self.bus.dead_letter(self.bus.names.kv_subject(bucket, key), encode(value), problem)
        return False

    async def _forever(self, what: str, follow: Callable[[Retry], Awaitable[None]]) -> None:
        """Run a watch for as long as the service runs; a failure costs one attempt, retried.
        `follow` calls `retry.succeeded()` at each change: the watch works again."""
        retry = Retry(log, f"following {what}", base_s=RETRY_FIRST_S, cap_s=RETRY_CAP_S, known=(BusError,))
        while True:
            await retry.attempt(partial(follow, retry))
            # A watch that ended on its own (it is not meant to) is started again after a pause.
            await anyio.sleep(retry.delay or RETRY_FIRST_S)

    async def _start_watches(self) -> None:
        retry = Retry(
            log, "reading the replicas bucket", base_s=RETRY_FIRST_S, cap_s=RETRY_CAP_S, known=(BusError,)
        )
        while True:
            try:
                await self._load()
                break
            except BusError as exc:
                retry.failed(exc)
                await retry.wait()
        retry.succeeded()
        self.proxy.loaded.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `task_status.started(port)` once the socket is bound."""
        try:
            async with anyio.create_task_group() as tg:
                port = await tg.start(
                    partial(
                        serve_app,
                        cors(self.proxy.app, self.config.http.cors_origins),
                        self.config.http.host,
                        self.config.http.port,
                        protocol=protocol(self.connections, self.proxy, ROUTED),
                        backlog=ACCEPT_BACKLOG,
                        reuse_port=self.reuse_port,
                    )
                )
                if self.worker is not None:
                    index, run_dir = self.worker
                    own = await tg.start(serve_metrics, self.proxy.metrics.registry, "127.0.0.1", 0)
                    worker_metrics.publish_port(run_dir, index, own)
                    self.proxy.peers = (str(index), partial(worker_metrics.peer_ports, run_dir, index))
                task_status.started(port)
                tg.start_soon(self._answer_held_at_stop)
                await tg.start(self.budgets.run)
                tg.start_soon(self.usage.run)
                await self._start_watches()
                tg.start_soon(self._forever, "the replicas bucket", self._follow_replicas)
                tg.start_soon(self._forever, "the deployments bucket", self._follow_deployments)
                tg.start_soon(self._forever, "placement's deployment statuses", self._follow_statuses)
                tg.start_soon(self._forever, "the keys bucket", self._follow_keys)
                tg.start_soon(self._forever, "the limits bucket", self._follow_limits)
                tg.start_soon(self._forever, "the shard statuses", self._follow_shard_statuses)
                if self.share is not None:
                    tg.start_soon(self._forever, "the routing bucket", self.share.follow)
                    tg.start_soon(self.share.write_forever)
                tg.start_soon(self._report_demand)
                log.info("reporting demand as gateway %s every %gs", self.id, self.config.demand_interval_s)
        finally:
            with anyio.CancelScope(shield=True):
                await self.client.aclose()
                await self.upstream.aclose()
