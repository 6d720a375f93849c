"""A shard's process logs on request: `<prefix>.launcher.<node>.logs`, answered from this node.

A request names a shard (and maybe a process, an offset or a tail); the reply
carries the lines of that process's log, scrubbed of the shard's secrets (an
engine may print its environment), its oldest lines dropped until it fits one
NATS message. A request that is not one, or names what is not here, is
answered with an error in words; a fault costs that one reply.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.engines import ShardSpec
from llmgw_core.errors import BusError
from llmgw_core.events import ShardLogs, ShardLogsRequest, decoder, encode
from llmgw_core.redact import scrub, secret_values

from . import procs
from .workers import Workers

log = logging.getLogger("llmgw.launcher")

# A logs reply stays under NATS's default max_payload (1 MiB), JSON escaping included.
LOGS_REPLY_BYTES = 900 * 1024


def process_logs(directory: Path) -> dict[str, Path]:
    """A shard's process logs by process name, in start order (`<index>-<name>.log`)."""
    found: list[tuple[int, str, Path]] = []
    with contextlib.suppress(OSError):
        for path in directory.glob("*.log"):
            index, _, name = path.stem.partition("-")
            if index.isdigit() and name:
                found.append((int(index), name, path))
    return {name: path for _, name, path in sorted(found)}


class LogsServer:
    """Answers this node's logs requests. `specs()` is the shards this launcher runs, by key;
    their logs are under `logs_dir/<key>/`."""

    def __init__(
        self,
        bus: Bus,
        node: str,
        logs_dir: Path,
        specs: Callable[[], Mapping[str, ShardSpec]],
        workers: Workers,
        environ: Mapping[str, str],
    ) -> None:
        self.bus = bus
        self.node = node
        self.logs_dir = logs_dir
        self.specs = specs
        self.workers = workers
        self.environ = environ

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until cancelled; a fault costs one reply."""
        subject = self.bus.names.launcher_logs(self.node)

        async def on_request(data: bytes) -> bytes:
            try:
                reply = await self.shard_logs(data)
            except Exception as exc:  # one bad request must not end the subscription
                log.exception("%s: cannot answer a logs request", subject)
                reply = ShardLogs(
                    node=self.node, shard="", error=f"launcher error: {type(exc).__name__}: {exc}"
                )
            return self.fit(reply)

        try:
            await self.bus.answer(subject, on_request, task_status=task_status)
        except BusError as exc:  # raised only before started: the launcher goes on without
            log.error("%s: cannot answer logs requests: %s", subject, exc)
            task_status.started()

    def fit(self, reply: ShardLogs) -> bytes:
        """The reply encoded, its oldest lines dropped until it fits one NATS message."""
        limit = min(LOGS_REPLY_BYTES, int(self.bus.max_payload or LOGS_REPLY_BYTES) - 4096)
        data = encode(reply)
        while len(data) > limit and reply.lines:
            reply = msgspec.structs.replace(reply, lines=reply.lines[max(1, len(reply.lines) // 10) :])
            data = encode(reply)
        return data

    async def shard_logs(self, data: bytes) -> ShardLogs:
        """The reply to one logs request: the lines of one of a shard's processes on this node."""
        try:
            request = decoder(ShardLogsRequest).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return ShardLogs(node=self.node, shard="", error=f"not a logs request: {exc}")
        key = self.bus.names.shard_key(self.node, request.shard)
        specs = self.specs()
        spec = specs.get(key)
        if spec is None:
            here = sorted(s.shard for s in specs.values())
            return ShardLogs(
                node=self.node,
                shard=request.shard,
                error=f"no shard {request.shard} on node {self.node} "
                f"(its shards: {', '.join(here) or 'none'})",
            )
        logs = await self.workers.files(process_logs, self.logs_dir / key)
        names = tuple(logs)
        if not names:
            return ShardLogs(
                node=self.node, shard=request.shard, error=f"shard {request.shard} has no logs yet"
            )
        process = request.process or names[-1]
        path = logs.get(process)
        if path is None:
            return ShardLogs(
                node=self.node,
                shard=request.shard,
                processes=names,
                error=f"shard {request.shard} has no process {process!r} (its processes: {', '.join(names)})",
            )
        start = request.offset if request.offset >= 0 else 0
        lines, offset = await self.workers.files(procs.read_from, path, start, LOGS_REPLY_BYTES)
        if request.offset < 0 and request.tail:
            lines = lines[-request.tail :]
        # An engine may print its environment: the secrets in it are not for the reader.
        secrets = secret_values(spec.profile.env, self.environ)
        return ShardLogs(
            node=self.node,
            shard=request.shard,
            process=process,
            processes=names,
            lines=tuple(scrub(line, secrets) for line in lines),
            offset=offset,
        )
