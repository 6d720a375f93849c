"""The one retry policy: jittered waits within their bounds, a cap, a reset, and an outage
said in two lines however many attempts it takes."""

from __future__ import annotations

import gc
import logging
import random
import re
import socket
import statistics
from pathlib import Path

import anyio
import anyio.abc
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Heartbeat, ShardStatus, now
from llmgw_core.lifecycle import connect_service
from llmgw_core.natsd import NatsServer
from llmgw_core.retry import Backoff, Retry
from llmgw_launcher.outbox import StatusOutbox
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

LOG = "llmgw.test.retry"


def test_every_wait_lies_between_the_base_and_a_ceiling_that_doubles_to_the_cap() -> None:
    rng = random.Random(24)
    for _ in range(200):
        backoff = Backoff(0.5, 10.0, rng=rng)
        for failures in range(1, 31):
            wait = backoff.next()
            assert 0.5 <= wait <= min(10.0, 0.5 * 2**failures)
    assert [backoff.ceiling(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_the_waits_are_spread_not_in_step() -> None:
    """Regression: every loop waited exactly 0.5 s, 1 s, 2 s...: services that lost NATS together
    came back in the same instant. Their first waits now cover [base, 2 x base]."""
    rng = random.Random(7)
    firsts = [Backoff(1.0, 60.0, rng=rng).next() for _ in range(1000)]
    assert len(set(firsts)) == 1000
    assert 1.0 <= min(firsts) < 1.05
    assert 1.95 < max(firsts) <= 2.0
    assert 1.45 < statistics.mean(firsts) < 1.55


def test_the_waits_grow_to_the_cap_as_fast_as_the_unjittered_loops_did() -> None:
    """The mean wait after n failures is about base x 2^(n-1), the old loops' wait; from the
    sixth failure on it is drawn between the base and the cap."""
    rng = random.Random(3)
    draws: list[list[float]] = [[] for _ in range(10)]
    for _ in range(2000):
        backoff = Backoff(1.0, 60.0, rng=rng)
        for n in range(10):
            draws[n].append(backoff.next())
    means = [statistics.mean(d) for d in draws]
    for n, mean in enumerate(means[:5], start=1):
        assert 2 ** (n - 1) <= mean <= 2 ** (n - 1) + 1, (n, means)
    assert all(29.0 < m < 32.0 for m in means[5:]), means
    assert max(max(d) for d in draws) <= 60.0


def test_a_reset_after_a_success_starts_the_waits_again() -> None:
    backoff = Backoff(0.2, 5.0, rng=random.Random(1))
    for _ in range(20):
        backoff.next()
    assert backoff.failures == 20
    backoff.reset()
    assert backoff.failures == 0
    assert 0.2 <= backoff.next() <= 0.4
    assert backoff.failures == 1


def test_a_base_above_the_cap_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^backoff of 10 s to 5 s: need 0 < base <= cap$"):
        Backoff(10.0, 5.0)
    with pytest.raises(ValueError, match=r"^backoff of 0 s to 5 s: need 0 < base <= cap$"):
        Backoff(0.0, 5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_outage_is_said_when_it_starts_and_when_it_ends_not_at_each_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real operation (a connection to a loopback port where nothing listens yet) fails
    five times, then a server comes up and it works: two lines, the cause in the first,
    how long and how many attempts in the second."""
    caplog.set_level(logging.DEBUG, logger=LOG)
    port = _free_port()
    retry = Retry(
        logging.getLogger(LOG), "reaching the test server", base_s=0.01, cap_s=0.05, known=(OSError,)
    )

    async def connect() -> None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        await stream.aclose()

    async with anyio.create_task_group() as tg:
        attempts = 0
        while True:
            attempts += 1
            if await retry.attempt(connect):
                break
            assert 0.01 <= retry.delay <= 0.05
            if attempts == 5:
                listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
                tg.start_soon(_serve, listener)
            await retry.wait()
        assert retry.delay == 0.0
        tg.cancel_scope.cancel()

    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 2, said
    (start_level, start), (end_level, end) = said
    assert start_level == end_level == logging.WARNING
    # anyio's words for a refused connection to every address of the host.
    assert start == "reaching the test server failed, retrying with backoff: All connection attempts failed"
    assert end.startswith("reaching the test server works again after ")
    assert end.endswith(" s and 5 failed attempts")
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 4
    # The next outage is a new one: said again.
    retry.failed("it broke again")
    assert caplog.records[-1].getMessage() == (
        "reaching the test server failed, retrying with backoff: it broke again"
    )


async def _serve(listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
    async def close(stream: anyio.abc.SocketStream) -> None:
        await stream.aclose()

    async with listener:
        await listener.serve(close)


async def test_an_unexpected_failure_is_logged_with_its_traceback_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOG)
    retry = Retry(logging.getLogger(LOG), "a step", base_s=0.01, cap_s=0.02, known=(OSError,))

    async def bug() -> None:
        raise KeyError("missing")

    for _ in range(3):
        assert not await retry.attempt(bug)
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "a step failed, retrying with backoff: 'missing'"
    assert record.exc_info is not None
    assert record.exc_info[0] is KeyError


async def test_a_fatal_failure_is_not_retried_but_raised() -> None:
    class Lost(Exception):
        pass

    retry = Retry(logging.getLogger(LOG), "leading", base_s=0.01, cap_s=0.02)

    async def lose() -> None:
        raise Lost("the lease is gone")

    with pytest.raises(Lost):
        await retry.attempt(lose, fatal=(Lost,))
    assert not retry.outage.ongoing


async def test_a_service_started_before_nats_says_once_that_it_waits_and_once_that_nats_answers(
    tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A service's connection (lifecycle.connect_service) to a real nats-server that is not
    there yet: one line when it starts waiting, with why; the attempts in between at debug
    level only; one line when it connects, with how long and how many attempts."""
    caplog.set_level(logging.DEBUG, logger="llmgw.lifecycle")
    port = _free_port()
    server = NatsServer(store_dir=tmp_path / "nats", port=port)
    options = BusOptions(url=f"nats://127.0.0.1:{port}", prefix=prefix, insecure=True, connect_timeout_s=2.0)
    connected: list[Bus] = []

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "llmgw.lifecycle" and r.levelno == level]

    async def connect() -> None:
        connected.append(await connect_service(options, "test-service", ensure=False))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(connect)
            # Three attempts have failed (the first said, the next two at debug level)...
            await eventually(lambda: len(said(logging.DEBUG)) >= 2, timeout=30)
            assert not connected
            # ...then NATS comes up, and the next attempt connects.
            await anyio.to_thread.run_sync(server.start)
            await eventually(lambda: connected, timeout=30)
        await connected[0].publish_core(f"{prefix}.test", Heartbeat(node="n", service="test", at=0.0))
    finally:
        for bus in connected:
            await bus.close()
        server.stop()
    warned = said(logging.WARNING)
    assert len(warned) == 2, warned
    assert warned[0].startswith("test-service: connecting to NATS failed, retrying with backoff: "), warned
    failures = len(said(logging.DEBUG)) + 1
    assert re.fullmatch(
        rf"test-service: connecting to NATS works again after \d+\.\d s and {failures} failed attempts",
        warned[1],
    ), warned
    assert failures >= 3


class _Said(logging.Handler):
    """What one llmgw logger says at WARNING and above, as text (caplog would keep each
    record's arguments, and with them nats-py's sockets past the test's end)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <(socket\\.socket|function StreamWriter\\.__del__|"
    "function _SelectorTransport\\.__del__):pytest.PytestUnraisableExceptionWarning"
)
@pytest.mark.timeout(180)
async def test_the_status_outbox_says_a_nats_outage_in_two_lines_and_writes_the_newest_status_after_it(
    tmp_path: Path, prefix: str
) -> None:
    """A launcher's statuses while its nats-server is down: one line when the writes start
    failing, none for each retry, one when a write lands again; the bucket then holds the
    newest status. Regression: the status that failed was written again after a newer one
    had landed, and the bucket said `starting` for good of an engine long ready."""
    server = NatsServer(store_dir=tmp_path / "nats")
    server.start()
    said = _Said()
    logger = logging.getLogger("llmgw.launcher")
    logger.addHandler(said)
    options = BusOptions(url=server.url, prefix=prefix, insecure=True)
    try:
        async with await Bus.connect(options, service="launcher") as bus:
            await bus.ensure()
            outbox = StatusOutbox(bus, "n1")
            key = bus.names.shard_key("n1", "s1")
            async with anyio.create_task_group() as tg:
                await tg.start(outbox.run)
                await anyio.to_thread.run_sync(server.stop)
                outbox.push(ShardStatus(node="n1", shard="s1", replica="r0", state="starting", at=now()))
                await eventually(
                    lambda: [ln for ln in said.lines if "writing shard statuses" in ln], timeout=60
                )
                outbox.push(ShardStatus(node="n1", shard="s1", replica="r0", state="ready", at=now()))
                # The retry of the failed `starting` comes due while `ready` is still on its way
                # (NATS is down yet): it must not be written after `ready` lands.
                await eventually(lambda: not outbox._retry_due, timeout=30)
                await anyio.to_thread.run_sync(server.start)

                async def stored() -> ShardStatus | None:
                    found = await bus.get(bus.names.shard_status_bucket, key, ShardStatus)
                    return found[0] if found and found[0].state == "ready" else None

                await eventually(stored, timeout=90, interval=0.5)
                await eventually(lambda: any("works again" in ln for ln in said.lines), timeout=30)
                # The retry of the failed `starting` has come due, and whatever it sent is sent:
                # the bucket still holds the newest status.
                await eventually(lambda: not outbox._retry_due, timeout=30)
                await outbox.flush()
                assert await stored() is not None
                tg.cancel_scope.cancel()
    finally:
        logger.removeHandler(said)
        server.stop()
        gc.collect()
    outage = [line for line in said.lines if "writing shard statuses" in line]
    assert len(outage) == 2, said.lines
    assert outage[0].startswith(
        "n1: writing shard statuses to the status bucket failed, retrying with backoff: "
    )
    assert outage[0].endswith("; each shard's newest is written again until one lands)")
    assert re.fullmatch(
        r"n1: writing shard statuses to the status bucket works again after \d+\.\d s "
        r"and \d+ failed attempts?",
        outage[1],
    ), outage
