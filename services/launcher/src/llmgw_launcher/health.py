"""Health probes of every engine on the node, through one client that keeps its connections.

One prober per launcher, not one HTTP client per shard: building an
`httpx.AsyncClient` builds an SSL context (about 16 ms of CPU, on the event
loop), and a general-purpose client spends over a millisecond of CPU per
request on this kind of machine, so a hundred shards probed every second
would take a fifth of a core. A probe here is one `GET` over a kept-alive
connection: a couple of hundred microseconds.

It is deliberately small. The request is built once per URL; the answer is
read only as far as a health check needs: the status line, then the body by
`Content-Length` so the connection can carry the next probe. An answer
without a length (chunked, or read to the close) still counts by its
status, and its connection is dropped instead of kept. h11 did the same job
at twice the CPU (its event objects and header validation were 40% of a
probe), and the sockets are driven directly, waiting on the event loop for
them to turn readable or writable, rather than through anyio's socket
streams, whose connect is a task group of its own (happy eyeballs).

A probe answers one question, "did the engine say 200 in time?", and never
raises: a refused connection, a reset, a timeout or a malformed answer is
"not healthy". vLLM binds its port before the model is loaded, so a
connection that gets no answer within the timeout is still loading, not ready.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
from urllib.parse import urlsplit

import anyio

# An engine's health answer is a few bytes; one that goes on past this is not
# a health endpoint, and its connection is not kept.
MAX_BODY = 64 * 1024
MAX_HEAD = 16 * 1024
# At most this many idle connections are kept per engine address.
IDLE_PER_ADDRESS = 2


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            view = view[sent:]

    async def receive(self) -> bytes:
        while True:
            try:
                return self.sock.recv(65536)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)


class HealthProber:
    """`await prober.healthy(url)`: True only for a 200 within `timeout_s`."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._resolved: dict[str, tuple[socket.AddressFamily, str]] = {}
        self._requests: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._closed = False
        # Counters for /metrics and the benchmarks: connections opened against probes sent
        # shows whether connections are kept.
        self.probes = 0
        self.connections_opened = 0
        self.failures = 0

    async def healthy(self, url: str) -> bool:
        return await self.check(url) is None

    async def check(self, url: str) -> str | None:
        """None if the engine answered 200 within the timeout; else what happened instead."""
        found = self._requests.get(url)
        if found is None:
            found = self._requests[url] = _request(url)
        addr, request = found
        self.probes += 1
        problem: str | None = f"no answer within {self.timeout_s:g}s"
        with anyio.move_on_after(self.timeout_s):
            problem = await self._probe(addr, request)
        if problem is not None:
            self.failures += 1
        return problem

    async def _probe(self, addr: tuple[str, int], request: bytes) -> str | None:
        conn = self._take(addr)
        if conn is not None:
            status = await self._use(conn, addr, request)
            if status is not None:
                return _verdict(status)
            # A kept connection the engine had closed (it restarted, or timed
            # the connection out) is not a failed check: one fresh try.
        conn_or_problem = await self._connect(addr)
        if isinstance(conn_or_problem, str):
            return conn_or_problem
        status = await self._use(conn_or_problem, addr, request)
        return "connection closed without an answer" if status is None else _verdict(status)

    async def _resolve(self, host: str) -> tuple[socket.AddressFamily, str] | None:
        """An address to connect to; a name is looked up once (in a worker thread), an IP is used as is."""
        found = self._resolved.get(host)
        if found is not None:
            return found
        try:
            ip = ipaddress.ip_address(host)
            found = (socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip))
        except ValueError:
            try:
                infos = await anyio.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except OSError:
                return None
            if not infos:
                return None
            family, _, _, _, sockaddr = infos[0]
            found = (family, str(sockaddr[0]))
        self._resolved[host] = found
        return found

    async def _connect(self, addr: tuple[str, int]) -> _Conn | str:
        """A new connection, or why there is none."""
        resolved = await self._resolve(addr[0])
        if resolved is None:
            return f"cannot resolve {addr[0]}"
        family, ip = resolved
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            return f"cannot open a socket: {exc.strerror or exc}"
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex((ip, addr[1]))
            if code == errno.EINPROGRESS:
                # To an engine on this host the answer (accepted, or refused while it
                # loads) is in before connect returns: then no turn of the loop is spent on it.
                if not _writable_now(sock):
                    await anyio.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code != 0:
                sock.close()
                return f"cannot connect: {os.strerror(code).lower()}"
        except OSError as exc:
            sock.close()
            return f"cannot connect: {(exc.strerror or str(exc)).lower()}"
        except BaseException:
            # Cancelled (the probe timed out) while connecting.
            sock.close()
            raise
        self.connections_opened += 1
        return _Conn(sock)

    async def _use(self, conn: _Conn, addr: tuple[str, int], request: bytes) -> int | None:
        """One exchange on `conn`, kept for the next probe if it can be; the status, or None if none came."""
        try:
            status, reusable = await _exchange(conn, request)
        except OSError:
            status, reusable = None, False
        except BaseException:
            # Cancelled mid-exchange (the probe timed out): the connection is
            # in an unknown state and is not kept.
            conn.sock.close()
            raise
        if reusable and not self._closed and len(self._idle.get(addr, ())) < IDLE_PER_ADDRESS:
            self._idle.setdefault(addr, []).append(conn)
        else:
            conn.sock.close()
        return status

    def _take(self, addr: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(addr)
        if not idle:
            return None
        conn = idle.pop()
        if not idle:
            del self._idle[addr]
        return conn

    async def forget(self, url: str) -> None:
        """Close the kept connections to an engine that is gone (its port may be reused)."""
        found = self._requests.pop(url, None)
        addr = found[0] if found else _request(url)[0]
        for conn in self._idle.pop(addr, []):
            conn.sock.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()


def _writable_now(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))


def _verdict(status: int) -> str | None:
    return None if status == 200 else f"answered {status}"


def _request(url: str) -> tuple[tuple[str, int], bytes]:
    """The address and the bytes of a `GET` of `url`, built once."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    head = f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept: */*\r\nUser-Agent: llmgw-launcher\r\n\r\n"
    return (host, port), head.encode("latin-1")


async def _exchange(conn: _Conn, request: bytes) -> tuple[int | None, bool]:
    """Send one request and read the answer: its status (None if none came), and whether the
    connection can carry the next probe."""
    await conn.send(request)
    buf = b""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > MAX_HEAD:
            return None, False
        data = await conn.receive()
        if not data:  # closed before it answered (a kept connection the engine had dropped)
            return None, False
        buf += data
    status, length, keep = parse_head(buf[:end])
    if status is None or length is None or not keep or length > MAX_BODY:
        return status, False
    got = len(buf) - end - 4
    while got < length:
        data = await conn.receive()
        if not data:
            return status, False
        got += len(data)
    return status, got == length


def parse_head(head: bytes) -> tuple[int | None, int | None, bool]:
    """Status, Content-Length (None if the body has no length) and keep-alive of a response head."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        return None, None, False
    keep = version != b"HTTP/1.0"
    length: int | None = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"transfer-encoding":
            return int(code), None, False
        elif name == b"connection":
            keep = value == b"keep-alive" if version == b"HTTP/1.0" else value != b"close"
    return int(code), length, keep
