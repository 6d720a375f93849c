"""The gateway's client for replica calls: one aiohttp connection pool for every replica.

Not httpx: httpcore's pool (1.0) walks every pooled connection on each request and each
answer's end, and checks every idle one's socket for readability, so its cost per request
grows with the connections held: at 256 requests in flight it was most of the gateway's
CPU. aiohttp's pool keeps idle connections per host in a list and takes the last one.

Answers are read raw (`auto_decompress=False`): bodies pass through byte for byte, their
`Content-Encoding` with them.
"""

from __future__ import annotations

import asyncio

import aiohttp

# Failures of a replica before any byte of its answer: the request goes to another. A timeout
# reading the answer (`SocketTimeoutError`, a `ServerTimeoutError` too) is not among them: a
# replica that is slow to answer may be working on it.
REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Any failure of a replica call: aiohttp's errors, and asyncio's timeout.
FAILED = (aiohttp.ClientError, asyncio.TimeoutError)


def before_answer(exc: BaseException) -> bool:
    """Whether `exc`, raised sending a request, means the replica never answered it: it
    refused the connection, or closed or reset it before its status line."""
    if isinstance(exc, REFUSED):
        return True
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return False
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))


class Upstream:
    """The pooled replica connections; the session is made in the running event loop, at the
    first call, and closed by `aclose`."""

    def __init__(
        self,
        *,
        limit: int = 100,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        pool_timeout_s: float = 60.0,
    ) -> None:
        self.limit = limit
        # `connect` is aiohttp's wait for a pooled connection, a new one's connect included;
        # `sock_connect` the connect alone.
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            connect=pool_timeout_s,
            sock_connect=connect_timeout_s,
            sock_read=read_timeout_s,
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, limit_per_host=0, ttl_dns_cache=60),
                timeout=self.timeout,
                auto_decompress=False,
                # Headers pass as the client sent them; a replica's cookies are not the gateway's.
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
