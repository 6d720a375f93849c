"""The bus's doors to what nats-py did for callers before: a stream's history (`replay`,
`history`, `last`, `stream_info`) and plain NATS (`request`, `answer`, `listen`), against
a real nats-server. A record that does not decode costs itself, never the others: it is
dead-lettered with its subject and the reader goes on."""

from __future__ import annotations

import contextlib
import time

import anyio
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus, BusOptions, DecodeFailure, NoAnswer, Replayed
from llmgw_core.events import InstallProgress, encode
from llmgw_core.natsd import NatsServer
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BAD = b'{"kind": "InstallProgress", "node": "gpu-01"}'


def progress(step: str) -> InstallProgress:
    return InstallProgress(node="gpu-01", engine="llamacpp", step=step, message=f"installing: {step}")


async def dlq_messages(bus: Bus) -> list[Msg]:
    sub = await bus.js.pull_subscribe(bus.names.dlq("test"), stream=bus.names.dlq_stream)
    try:
        return await sub.fetch(batch=10, timeout=2)
    finally:
        await sub.unsubscribe()


async def replayed(bus: Bus, subject: str, **kwargs: object) -> list[Replayed[InstallProgress] | None]:
    out: list[Replayed[InstallProgress] | None] = []
    records = bus.replay(subject, InstallProgress, **kwargs)  # type: ignore[arg-type]
    async with contextlib.aclosing(records):
        async for record in records:
            out.append(record)
    return out


async def test_a_bad_record_in_the_middle_is_dead_lettered_and_the_others_come_out(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-01")
    await bus.publish(subject, progress("downloading"))
    await bus.js.publish(subject, BAD)  # a writer that skipped validation
    await bus.publish(subject, progress("verifying"))

    found = await replayed(bus, subject)

    assert [r.value.step for r in found if r is not None] == ["downloading", "verifying"]
    assert all(r is not None and r.subject == subject and r.time > 0 for r in found)
    assert bus.decode_errors[subject] == 1
    [dead] = await dlq_messages(bus)
    assert dead.data == BAD
    assert dead.headers is not None
    assert dead.headers["Llmgw-Subject"] == subject
    assert dead.headers["Llmgw-Error"] == "Object missing required field `engine`"
    # The list form reads the same, and dead-letters the bad one again.
    assert [p.step for p in await bus.history(subject, InstallProgress, idle_s=0.3)] == [
        "downloading",
        "verifying",
    ]
    assert bus.decode_errors[subject] == 2


async def test_an_empty_history_ends(bus: Bus) -> None:
    with anyio.fail_after(5):
        assert await replayed(bus, bus.names.node_install("nobody"), idle_s=0.2) == []


async def test_since_leaves_out_what_came_before(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-01")
    await bus.publish(subject, progress("old"))
    after = time.time()
    await bus.publish(subject, progress("new"))

    found = await replayed(bus, subject, since=after)

    assert [r.value.step for r in found if r is not None] == ["new"]


async def test_follow_says_when_caught_up_then_yields_what_comes(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-01")
    await bus.publish(subject, progress("downloading"))
    seen: list[str | None] = []

    async with anyio.create_task_group() as tg:

        async def follow() -> None:
            records = bus.replay(subject, InstallProgress, follow=True, idle_s=0.2)
            async with contextlib.aclosing(records):
                async for record in records:
                    seen.append(None if record is None else record.value.step)

        tg.start_soon(follow)
        await eventually(lambda: seen == ["downloading", None])
        await bus.js.publish(subject, b"\x00not json{")
        await bus.publish(subject, progress("done"))
        await eventually(lambda: seen == ["downloading", None, "done"])
        tg.cancel_scope.cancel()

    assert bus.decode_errors[subject] == 1


async def test_last_reads_the_last_record_and_dead_letters_a_bad_one(bus: Bus) -> None:
    stream = bus.names.events_stream
    subject = bus.names.node_install("gpu-01")
    assert await bus.last(stream, subject, InstallProgress) is None
    await bus.publish(subject, progress("downloading"))
    await bus.publish(subject, progress("verifying"))
    last = await bus.last(stream, subject, InstallProgress)
    assert last is not None
    assert last.step == "verifying"

    await bus.js.publish(subject, BAD)
    assert await bus.last(stream, subject, InstallProgress) is None
    assert bus.decode_errors[subject] == 1
    assert (await bus.stream_info(stream)).state.messages == 3


async def test_request_and_answer(bus: Bus) -> None:
    subject = bus.names.liveness_request
    asked: list[bytes] = []

    async def answer(data: bytes) -> bytes:
        asked.append(data)
        if data == encode(progress("fail")):
            raise RuntimeError("the handler failed")
        if data == encode(progress("bad")):
            return BAD
        return encode(progress("answered"))

    with pytest.raises(NoAnswer) as nobody:
        await bus.request(subject, None, InstallProgress, timeout=0.5)
    assert not nobody.value.responders
    assert str(nobody.value) == f"nobody answers on {subject}"

    async with anyio.create_task_group() as tg:
        await tg.start(bus.answer, subject, answer)
        reply = await bus.request(subject, None, InstallProgress, timeout=2)
        assert reply.step == "answered"
        assert asked == [b""]

        # A handler that raises leaves that request unanswered, and the next one is answered.
        with pytest.raises(NoAnswer) as late:
            await bus.request(subject, progress("fail"), InstallProgress, timeout=0.3)
        assert late.value.responders
        with pytest.raises(DecodeFailure):
            await bus.request(subject, progress("bad"), InstallProgress, timeout=2)
        assert bus.decode_errors[subject] == 1
        assert (await bus.request(subject, progress("ask"), InstallProgress, timeout=2)).step == "answered"
        tg.cancel_scope.cancel()


async def test_listen_hands_over_subject_and_bytes_and_outlives_a_failing_handler(bus: Bus) -> None:
    heard: list[tuple[str, bytes]] = []

    async def handler(subject: str, data: bytes) -> None:
        heard.append((subject, data))
        if data == b"boom":
            raise RuntimeError("the handler failed")

    subject = bus.names.weights_query("gpu-02")
    async with anyio.create_task_group() as tg:
        await tg.start(bus.listen, bus.names.weights_query("*"), handler)
        await bus.nc.publish(subject, b"boom")
        await bus.nc.publish(subject, b"after")
        await eventually(lambda: heard == [(subject, b"boom"), (subject, b"after")])
        tg.cancel_scope.cancel()


async def test_following_survives_a_server_restart_without_a_record_twice(
    own_nats: NatsServer, prefix: str
) -> None:
    bus = await Bus.connect(BusOptions(url=own_nats.url, prefix=prefix, insecure=True), service="test")
    await bus.ensure()
    subject = bus.names.node_install("gpu-01")
    seen: list[str | None] = []
    try:
        async with anyio.create_task_group() as tg:

            async def follow() -> None:
                records = bus.replay(subject, InstallProgress, follow=True, idle_s=0.2)
                async with contextlib.aclosing(records):
                    async for record in records:
                        seen.append(None if record is None else record.value.step)

            await bus.publish(subject, progress("first"))
            tg.start_soon(follow)
            await eventually(lambda: seen == ["first", None])

            await anyio.to_thread.run_sync(own_nats.restart)
            await eventually(lambda: bus.connected, timeout=15)
            await bus.publish(subject, progress("second"))
            await eventually(lambda: seen == ["first", None, "second"], timeout=15)
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
