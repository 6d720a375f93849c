"""A TCP link on loopback between NATS clients and a test's server that can lose the server's
answers: after a client sends a chosen subject, what the server sends that client back is
dropped for a while and the connection then cut, as on a link that failed mid-request. The
server has the request and acts on it (a write lands); the client never hears so, times out,
reconnects through the link and goes on. Plain TCP only (the bytes are read for the subject)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class NatsLink:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._marker: bytes | None = None
        self._deaf_s = 0.0
        # Set once a client sent the marker and its answers began to be dropped.
        self.lost = asyncio.Event()
        # Set once that client's connection was cut.
        self.cut = asyncio.Event()
        # Set to cut it before `deaf_s` is over.
        self._cut_now = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def lose_answers_after(self, subject: str, deaf_s: float) -> None:
        """The next client to publish to `subject` hears nothing more from the server for
        `deaf_s` seconds (the server still gets everything it sends), then is cut off."""
        self._marker = f" {subject} ".encode()
        self._deaf_s = deaf_s
        self.lost = asyncio.Event()
        self.cut = asyncio.Event()
        self._cut_now = asyncio.Event()

    def cut_now(self) -> None:
        """Cut the connection whose answers are lost now, not at the end of `deaf_s`."""
        self._cut_now.set()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        deaf: asyncio.Event,
        *,
        watch: bool,
        on_marker: asyncio.Event,
    ) -> None:
        tail = b""
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if watch and self._marker is not None and self._marker in tail + data:
                    self._marker = None
                    on_marker.set()  # before the server can answer
                    writer.write(data)
                    await writer.drain()
                    tail = b""
                    continue
                # Enough of the bytes read to find a subject split across two reads, and no more.
                keep = len(self._marker) - 1 if self._marker else 0
                tail = (tail + data)[-keep:] if keep else b""
                if not watch and deaf.is_set():
                    continue  # the server's answer, lost
                writer.write(data)
                await writer.drain()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        deaf = asyncio.Event()
        up = asyncio.ensure_future(self._pipe(client_r, server_w, deaf, watch=True, on_marker=deaf))
        down = asyncio.ensure_future(self._pipe(server_r, client_w, deaf, watch=False, on_marker=deaf))
        deafened = asyncio.ensure_future(deaf.wait())
        try:
            await asyncio.wait({up, down, deafened}, return_when=asyncio.FIRST_COMPLETED)
            if deaf.is_set():
                self.lost.set()
                cut = asyncio.ensure_future(self._cut_now.wait())
                await asyncio.wait({up, down, cut}, timeout=self._deaf_s, return_when=asyncio.FIRST_COMPLETED)
                cut.cancel()
                self.cut.set()
        finally:
            for task in (up, down, deafened):
                task.cancel()
            for w in (client_w, server_w):
                w.close()

    def _start(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(client_r, client_w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@contextlib.asynccontextmanager
async def nats_link(upstream_port: int) -> AsyncIterator[NatsLink]:
    link = NatsLink(upstream_port)
    server = await asyncio.start_server(link._start, "127.0.0.1", 0)
    link.port = server.sockets[0].getsockname()[1]
    try:
        yield link
    finally:
        server.close()
        for task in list(link._tasks):
            task.cancel()
        await asyncio.gather(*link._tasks, return_exceptions=True)
