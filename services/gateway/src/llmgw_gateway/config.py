"""`gateway.yaml`: where the gateway listens, how it reaches NATS, and whether clients need a key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from msgspec import Meta, Struct

from llmgw_core.config import NatsConfig
from llmgw_core.errors import ConfigError


class HttpConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    # 0: any free port (printed at start).
    port: int = 8000
    # Clients must send `Authorization: Bearer <key>`: a key of the keys bucket (`llmgw ctl keys
    # create`), or one of `api_keys_file` (one a line, `#` comments; every model, no limits).
    # false: the endpoint is open to anyone who can reach it.
    require_api_key: bool = True
    api_keys_file: str = ""
    # A client must send a request's headers within header_timeout_s of connecting (or, on a
    # kept-alive connection, of the request's first byte), then its whole body within
    # body_timeout_s; else the gateway closes the connection. Bytes trickled slowly extend
    # neither: a client sending a header every 5 s is closed like one that sends nothing.
    header_timeout_s: Annotated[float, Meta(gt=0)] = 20.0
    body_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    # A request's head: one header (its name and value) of at most max_header_field_bytes, at
    # most max_header_fields headers, and its target and header lines together at most
    # max_header_section_bytes; past any, 431 and the connection closed.
    max_header_field_bytes: Annotated[int, Meta(ge=256)] = 16 << 10
    max_header_fields: Annotated[int, Meta(ge=8)] = 100
    max_header_section_bytes: Annotated[int, Meta(ge=1024)] = 64 << 10
    # Bytes of request heads held at once, every connection's (still arriving, or of a request
    # in progress). At the limit a new head closes the connection whose head has been arriving
    # longest; where every head held is a request's in progress, it is answered 503.
    header_bytes_in_flight: Annotated[int, Meta(ge=1 << 20)] = 64 << 20
    # Client connections held at once. At the limit a new connection closes the one that has
    # waited longest without a request in progress (idle, or still sending its headers); when
    # every one has a request in progress it is answered 503 and closed. 0: as many as the
    # open-file limit (`ulimit -n`, raised to its hard limit at start) allows, each client
    # counted twice (its connection, and the replica connection its request holds) after
    # reserved_fds: (limit - reserved_fds) / 2. A value the limit cannot hold is refused at start.
    max_connections: Annotated[int, Meta(ge=0)] = 0
    # Descriptors kept out of that count: NATS, logs, the listener, and the up to 128
    # connections that one pass of the accept loop takes before any of them is counted.
    reserved_fds: Annotated[int, Meta(ge=160)] = 256
    # Web pages (origins: `http://placement.example:8080`) whose scripts may call the API from
    # a browser, such as the cluster page's chat box; `*` for any. The key still comes from
    # the user: this only lets the browser hand over the answer. (): none (no CORS headers).
    cors_origins: tuple[str, ...] = ()
    # Processes serving this port, each a whole gateway of its own (its connections, prefix
    # index and demand report) sharing the keys and their limits over the bus: more than 1
    # uses more than one core. 1: one process, no supervisor. 0: one per CPU the gateway may
    # run on. `llmgw-gateway --workers N` overrides it.
    workers: int = 1


class RoutingConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Prompts that share a prefix go to the replica the gateway last sent that prefix to (its
    # engine likely holds it in its prompt cache), within the load bound; a prefix it sent
    # nowhere yet, to the least busy replica with room for it (prefix_balance), ties to the one
    # its first min_match_blocks blocks hash to (the same choice in every gateway process and
    # worker that was sent the same prefixes); false: least outstanding requests only.
    prefix_aware: bool = True
    # The prompt is hashed in blocks of this many bytes (of its text as the request carries it),
    # each block's hash covering every block before it.
    block_bytes: Annotated[int, Meta(ge=16, le=65536)] = 256
    # A match shorter than this many blocks is no match: a short shared system prompt alone
    # must not pin every request to one replica.
    min_match_blocks: Annotated[int, Meta(ge=1)] = 4
    # Only the prompt's first max_blocks blocks are hashed: the per-request cost is bounded
    # however long the prompt.
    max_blocks: Annotated[int, Meta(ge=1, le=4096)] = 128
    # A replica takes a request for its prefix only while its requests in flight are at most
    # load_factor times the mean over the deployment's replicas, plus one.
    load_factor: Annotated[float, Meta(ge=1.0)] = 1.25
    # A prefix no replica holds goes only to a replica that was sent at most prefix_balance
    # times the mean of the prompt blocks (the index's) the deployment's replicas were sent: the
    # replicas' prompt caches fill evenly, a replica's cache never holding a larger share of the
    # customers while another's has room.
    prefix_balance: Annotated[float, Meta(ge=1.0)] = 1.25
    # Block hashes remembered (least recently routed forgotten first), across deployments.
    index_blocks: Annotated[int, Meta(ge=1)] = 65536
    # Block hashes remembered per replica (its least recently routed forgotten first, as its
    # engine's prompt cache evicts), here and in the routing bucket every gateway shares (sized
    # for 1,024 a replica: more needs `nats: bucket_max_bytes: {routing: …}` in placement's config).
    replica_blocks: Annotated[int, Meta(ge=1, le=16384)] = 1024
    # Every gateway shares what each replica is believed to hold through the routing bucket:
    # what one routed, the others route by, and a gateway that starts knows it. false: each
    # gateway routes by what it routed itself.
    shared: bool = True
    # The replicas whose blocks changed are written to the routing bucket at most this often
    # (one write per replica per interval, never one per request).
    share_interval_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    # A replica holding a prompt's prefix takes it only while the match (in blocks) is at least
    # match_per_load times its load (requests in flight from here, or its engine's running and
    # waiting where more) above the least busy replica's: a hot prefix spills.
    match_per_load: Annotated[float, Meta(ge=0, le=4096)] = 4.0
    # A chat or completion answer its replica broke off (it died, or cut the connection) is
    # continued on another ready replica of the deployment, from what the client already has,
    # at most this many times per request (docs/gateway.md, "Continuation"); 0: never, the
    # stream ends with an error event.
    continuations: Annotated[int, Meta(ge=0, le=16)] = 2


class OutliersConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Outlier detection (docs/gateway.md): a replica whose answers fail is taken out of routing
    for a while, and placement is told, as Envoy's outlier detection does."""

    # false: every replica is routed to however its answers go (placement is still told).
    enabled: bool = True
    # Failures in a row (5xx, connection refused or reset, no first byte in time) that take a
    # replica out of routing; 0: never on this count alone.
    consecutive_failures: Annotated[int, Meta(ge=0, le=1_000_000)] = 5
    # Over the last window_s, a replica with at least min_requests attempts whose share of
    # successes is below min_success_rate is taken out too (min_success_rate 0: never).
    window_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    min_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 10
    min_success_rate: Annotated[float, Meta(ge=0, le=1)] = 0.5
    # The n-th time in a row a replica is taken out, it stays out base_ejection_s x n, at most
    # max_ejection_s.
    base_ejection_s: Annotated[float, Meta(gt=0, le=86_400)] = 30.0
    max_ejection_s: Annotated[float, Meta(gt=0, le=86_400)] = 300.0
    # The most of a deployment's replicas out at once, in percent; never its last one (its
    # requests keep going to it and its own 5xx tells the client why).
    max_ejection_percent: Annotated[int, Meta(ge=0, le=100)] = 50


class GatewayConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nats: NatsConfig = NatsConfig()
    http: HttpConfig = HttpConfig()
    # The most a client may send in one request body.
    max_body_bytes: int = 8 << 20
    # How deep a request body's JSON may nest (arrays and objects inside each other); deeper
    # is refused with 400 before it is parsed. At most 512: Python's parser recurses per level.
    max_json_depth: Annotated[int, Meta(ge=1, le=512)] = 128
    # How long to wait for a replica to accept a connection before trying another.
    connect_timeout_s: float = 5.0
    # How long to wait for the first byte of an answer, then between bytes (0: no limit;
    # a long generation streams slowly, and a queued request waits its turn).
    read_timeout_s: float = 600.0
    routing: RoutingConfig = RoutingConfig()
    # This gateway's name in its demand reports (`<prefix>.demand.<id>`), which the autoscaler
    # sums across gateways: letters, digits, '-' and '_'. "": the host's name, the process id
    # and a random tail, new at each start (placement forgets a silent gateway's last report
    # after a few of its intervals); a fixed id lets a restarted gateway's report replace its own.
    id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]*$", max_length=96)] = ""
    # Seconds between demand reports (a report also goes at once when a request starts being held).
    demand_interval_s: Annotated[float, Meta(gt=0, le=60)] = 1.0
    # A request for a deployment with no ready replica (scaled to zero, starting) waits for one:
    # up to hold_queue requests per deployment (more: 429), each up to hold_timeout_s (then
    # 503 quoting the replicas' states). Either 0: such a request is answered 503 at once.
    hold_queue: Annotated[int, Meta(ge=0)] = 100
    hold_timeout_s: Annotated[float, Meta(ge=0)] = 120.0
    # Held requests go out, once a replica can take them, at most this many a second per
    # deployment, first come first: a replica that has just started is not sent every one at once.
    hold_release_per_s: Annotated[float, Meta(gt=0)] = 100.0
    # Replicas judged by their answers: taken out of routing while they fail (outliers.py).
    outliers: OutliersConfig = OutliersConfig()

    def __post_init__(self) -> None:
        # ValueError: msgspec reports it with the file's name, as any other mistake in it.
        if self.http.workers < 0:
            raise ValueError(workers_problem(self.http.workers))
        if self.http.api_keys_file and not self.http.require_api_key:
            raise ValueError(
                "http: api_keys_file is set but http: require_api_key is false; "
                "set require_api_key: true to check client keys, or drop api_keys_file"
            )


def workers_problem(workers: int) -> str:
    return (
        f"http: workers is {workers}; give the number of gateway processes to serve the port "
        "(1: one, as without workers; 0: one per CPU)"
    )


def worker_count(workers: int) -> int:
    """How many processes `http: workers` asks for: 0 is one per CPU this process may run on
    (its affinity, which a container's or taskset's limit narrows), not every CPU of the host."""
    if workers < 0:
        raise ConfigError(workers_problem(workers))
    if workers == 0:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return workers


def load_api_keys(path: str) -> frozenset[str]:
    """The client keys in `path`, or ConfigError saying what is wrong with the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read http: api_keys_file {path}: {exc.strerror or exc}") from exc
    keys = frozenset(
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise ConfigError(f"http: api_keys_file {path} holds no key; write one client key a line")
    return keys
