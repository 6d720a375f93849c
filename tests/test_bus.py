from __future__ import annotations

import anyio
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import ATOMIC_MAX, Bus, BusOptions, KVChange, Writes, _Write
from llmgw_core.errors import BusError
from llmgw_core.events import InstallProgress, encode
from llmgw_core.natsd import NatsServer
from tests.bus_support import consume
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def progress(step: str) -> InstallProgress:
    return InstallProgress(node="gpu-01", engine="llamacpp", step=step, message=f"installing: {step}")


async def dlq_messages(bus: Bus) -> list[Msg]:
    sub = await bus.js.pull_subscribe(bus.names.dlq("test"), stream=bus.names.dlq_stream)
    try:
        return await sub.fetch(batch=10, timeout=2)
    finally:
        await sub.unsubscribe()


async def test_bad_messages_go_to_the_dlq_and_the_consumer_keeps_consuming(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-01")
    handled: list[InstallProgress] = []

    async def handler(value: InstallProgress, msg: Msg) -> None:
        handled.append(value)

    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: consume(
                bus, subject, InstallProgress, handler, durable="t1", task_status=task_status
            )
        )
        await bus.js.publish(subject, b"\x00not json{")
        await bus.js.publish(subject, b'{"kind": "InstallProgress", "node": "gpu-01"}')
        await bus.publish(subject, progress("downloading"))
        await eventually(lambda: len(handled) == 1)
        # Still consuming after two bad ones.
        await bus.publish(subject, progress("verifying"))
        await eventually(lambda: [h.step for h in handled] == ["downloading", "verifying"])
        tg.cancel_scope.cancel()

    assert bus.decode_errors[subject] == 2
    dead = await dlq_messages(bus)
    assert [m.data for m in dead] == [
        b"\x00not json{",
        b'{"kind": "InstallProgress", "node": "gpu-01"}',
    ]
    assert all(m.headers and m.headers["Llmgw-Subject"] == subject for m in dead)
    assert dead[0].headers is not None
    assert dead[0].headers["Llmgw-Error"].startswith("JSON is malformed")
    assert dead[1].headers is not None
    assert dead[1].headers["Llmgw-Error"] == "Object missing required field `engine`"


async def test_a_bad_message_is_not_redelivered(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-02")
    handled: list[str] = []

    async def handler(value: InstallProgress, msg: Msg) -> None:
        handled.append(value.step)

    await bus.js.publish(subject, b"garbage")
    await bus.publish(subject, progress("done"))
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: consume(
                bus, subject, InstallProgress, handler, durable="t2", task_status=task_status
            )
        )
        await eventually(lambda: handled == ["done"])
        tg.cancel_scope.cancel()
    info = await bus.js.consumer_info(bus.names.events_stream, "t2")
    assert info.num_ack_pending == 0
    assert info.num_redelivered == 0


async def test_same_msg_id_is_stored_once(bus: Bus) -> None:
    subject = bus.names.node_install("gpu-01")
    first = await bus.publish(subject, progress("downloading"), msg_id="install-1")
    second = await bus.publish(subject, progress("downloading"), msg_id="install-1")
    assert first == second
    info = await bus.js.stream_info(bus.names.events_stream)
    assert info.state.messages == 1


async def test_publishes_without_a_msg_id_get_distinct_ids(bus: Bus) -> None:
    """Message ids are a per-client prefix and a counter (cheaper than a uuid4 each): two
    publishes of the same event must still both be stored, each with its own id."""
    subject = bus.names.node_install("gpu-01")
    first = await bus.publish(subject, progress("same"))
    second = await bus.publish(subject, progress("same"))
    assert second == first + 1
    ids = set()
    for seq in (first, second):
        msg = await bus.js.get_msg(bus.names.events_stream, seq=seq, direct=False)
        assert msg.headers is not None
        ids.add(msg.headers["Nats-Msg-Id"])
    assert len(ids) == 2


async def test_publish_carries_msg_id_and_trace_headers(bus: Bus) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    subject = bus.names.node_facts("gpu-01")
    with tracer.start_as_current_span("ctl deploy") as span:
        await bus.publish(subject, progress("x"), msg_id="abc")
        trace_id = format(span.get_span_context().trace_id, "032x")
    msg = await bus.js.get_msg(bus.names.events_stream, subject=subject, direct=False)
    assert msg.headers is not None
    assert msg.headers["Nats-Msg-Id"] == "abc"
    assert msg.headers["traceparent"].split("-")[1] == trace_id
    assert trace.get_tracer_provider() is not provider


async def test_kv_watch_yields_current_values_then_changes(bus: Bus) -> None:
    bucket = bus.names.nodes_bucket
    await bus.put(bucket, "a", progress("one"))
    await bus.put(bucket, "b", progress("two"))
    seen: list[tuple[str, str | None]] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            async for change in bus.watch(bucket, InstallProgress):
                seen.append((change.key, change.value.step if change.value else None))

        tg.start_soon(watch)
        await eventually(lambda: seen == [("a", "one"), ("b", "two")])
        await bus.put(bucket, "a", progress("three"))
        await bus.delete(bucket, "b")
        await eventually(lambda: seen[2:] == [("a", "three"), ("b", None)])
        tg.cancel_scope.cancel()


async def test_kv_watch_survives_a_server_restart(own_nats: NatsServer, prefix: str) -> None:
    bus = await Bus.connect(BusOptions(url=own_nats.url, prefix=prefix, insecure=True), service="test")
    await bus.ensure()
    bucket = bus.names.shards_bucket
    seen: list[KVChange[InstallProgress]] = []
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for change in bus.watch(bucket, InstallProgress):
                    seen.append(change)

            tg.start_soon(watch)
            await bus.put(bucket, "n1.s1", progress("first"))
            await eventually(lambda: [c.value.step for c in seen if c.value] == ["first"])

            await anyio.to_thread.run_sync(own_nats.restart)
            # The write lands after the restart, through the client's reconnect.
            await eventually(lambda: bus.nc.is_connected, timeout=15)
            await bus.put(bucket, "n1.s1", progress("second"))
            await eventually(
                lambda: [c.value.step for c in seen if c.value] == ["first", "second"], timeout=15
            )
            tg.cancel_scope.cancel()
    finally:
        await bus.close()


async def test_a_bad_kv_value_is_skipped_and_dead_lettered(bus: Bus) -> None:
    bucket = bus.names.nodes_bucket
    kv = await bus.kv(bucket)
    await kv.put("bad", b"{nope")
    await kv.put("good", encode(progress("ok")))
    snapshot = await bus.entries(bucket, InstallProgress)
    assert list(snapshot) == ["good"]
    assert bus.decode_errors[f"$KV.{bucket}.bad"] == 1


async def test_a_snapshot_holds_each_keys_last_value_and_nothing_deleted_empty_or_bad(bus: Bus) -> None:
    """`entries` reads each key's last message: deletes and purges drop a key, an empty or
    undecodable value is dead-lettered and left out, and a key filter keeps to its keys."""
    bucket = bus.names.nodes_bucket
    kv = await bus.kv(bucket)
    for step in ("one", "two", "three"):
        last = await bus.put(bucket, "a.x", progress(step))
    await bus.put(bucket, "a.gone", progress("x"))
    await bus.delete(bucket, "a.gone")
    await bus.put(bucket, "a.purged", progress("x"))
    await kv.purge("a.purged")
    await kv.put("a.empty", b"")
    await kv.put("a.bad", b"{nope")
    await bus.put(bucket, "b.y", progress("other"))
    found = await bus.entries(bucket, InstallProgress)
    assert {k: (c.value.step if c.value else None) for k, c in found.items()} == {
        "a.x": "three",
        "b.y": "other",
    }
    assert found["a.x"].revision == last
    assert bus.decode_errors[f"$KV.{bucket}.a.empty"] == 1
    assert bus.decode_errors[f"$KV.{bucket}.a.bad"] == 1
    assert list(await bus.entries(bucket, InstallProgress, "b.*")) == ["b.y"]
    assert await bus.entries(bucket, InstallProgress, "c.*") == {}


async def test_commit_writes_puts_deletes_and_events_as_atomic_batches(bus: Bus) -> None:
    """Many writes of one step: one atomic batch per stream, puts and deletes as a KV sees them."""
    names = bus.names
    bucket = names.replicas_bucket
    await bus.put(bucket, "gone", progress("old"))
    writes = Writes()
    for i in range(ATOMIC_MAX + 3):  # more than one batch
        writes.put(bucket, f"k{i}", progress(f"s{i}"))
    writes.delete(bucket, "gone")
    writes.publish(
        names.node_install("gpu-01"), progress("event"), traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    )
    assert await bus.batches.atomic_allowed(f"KV_{bucket}")
    assert await bus.batches.atomic_allowed(names.events_stream)
    await bus.commit(writes)
    found = await bus.entries(bucket, InstallProgress)
    assert found["k0"].value == progress("s0")
    assert found[f"k{ATOMIC_MAX + 2}"].value == progress(f"s{ATOMIC_MAX + 2}")
    assert "gone" not in found
    [event] = await bus.history(names.node_install("gpu-01"), InstallProgress, idle_s=0.3)
    assert event.step == "event"


async def test_commit_writes_one_by_one_where_a_stream_takes_no_batches(bus: Bus) -> None:
    stream = f"KV_{bus.names.nodes_bucket}"
    config = (await bus.js.stream_info(stream)).config
    config.allow_atomic = False
    await bus.js.update_stream(config)
    bus.batches.atomic.pop(stream, None)
    writes = Writes()
    for i in range(5):
        writes.put(bus.names.nodes_bucket, f"n{i}", progress(f"s{i}"))
    await bus.commit(writes)
    assert bus.batches.atomic[stream] is False
    assert sorted(await bus.entries(bus.names.nodes_bucket, InstallProgress)) == [f"n{i}" for i in range(5)]


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "pipelined"])
async def test_batched_events_carry_message_ids_and_a_commit_retried_stores_them_once(
    bus: Bus, atomic: bool
) -> None:
    """Regression: events sent in an atomic batch carried no Nats-Msg-Id, so a commit retried
    after a lost acknowledgement stored them twice and a reader de-duplicating on the id was
    misled. A whole batch the server holds already is refused as a duplicate (error 10201):
    that commit counts as written."""
    stream = bus.names.events_stream
    if not atomic:
        config = (await bus.js.stream_info(stream)).config
        config.allow_atomic = False
        await bus.js.update_stream(config)
    bus.batches.atomic.pop(stream, None)
    subject = bus.names.node_install(f"gpu-{atomic}")
    writes = Writes()
    for i in range(3):
        writes.publish(subject, progress(f"e{i}"))
    await bus.commit(writes)
    await bus.commit(writes)  # as a retry after a lost acknowledgement would
    assert bus.batches.atomic[stream] is atomic
    stored = await bus.history(subject, InstallProgress, idle_s=0.3)
    assert [e.step for e in stored] == ["e0", "e1", "e2"]
    ids = set()
    last = await bus.js.get_msg(stream, subject=subject, direct=False)
    for seq in range(last.seq - 2, last.seq + 1):
        msg = await bus.js.get_msg(stream, seq=seq, direct=False)
        assert msg.headers is not None
        ids.add(msg.headers["Nats-Msg-Id"])
    assert len(ids) == 3


async def test_a_refused_batch_writes_nothing_and_says_why(bus: Bus) -> None:
    """A batch the server refuses (here: one message over its payload limit) lands not at all."""
    writes = Writes()
    writes.put(bus.names.catalog_bucket, "a", progress("a"))
    writes.items.append(_Write(f"$KV.{bus.names.catalog_bucket}.b", b"x" * (bus.nc.max_payload + 1), {}))
    with pytest.raises(BusError):
        await bus.commit(writes)
    assert await bus.get(bus.names.catalog_bucket, "a", InstallProgress) is None


async def test_a_bucket_created_by_another_service_meanwhile_is_used(own_nats: NatsServer) -> None:
    """Regression: an unauthenticated node and placement ensured the streams together. One
    created a bucket and set allow_atomic on it between the other's lookup and its create;
    the other's create failed with "stream name already in use with a different
    configuration", and that service exited. The lookup here answers as it did then: not
    found, just before the first service created the bucket."""
    options = BusOptions(url=own_nats.url, prefix="race", insecure=True)
    first = await Bus.connect(options, service="placement")
    late = await Bus.connect(options, service="node")
    try:
        await first.ensure()
        assert await first.batches.atomic_allowed(f"KV_{first.names.replicas_bucket}")
        lookup = late.js.key_value
        missed: list[str] = []

        async def not_yet(bucket: str) -> object:
            if bucket not in missed:
                missed.append(bucket)
                raise nats.js.errors.BucketNotFoundError
            return await lookup(bucket)

        late.js.key_value = not_yet  # type: ignore[method-assign]
        await late.ensure()
        assert set(missed) == set(late.names.buckets())
        await late.put(late.names.replicas_bucket, "k", progress("x"))
        assert await first.get(first.names.replicas_bucket, "k", InstallProgress) is not None
    finally:
        await first.close()
        await late.close()


async def test_closing_with_a_subscription_nobody_reads_takes_seconds_not_30(
    nats_url: str, prefix: str
) -> None:
    """Regression: a watch that stopped reading (its task ended) left messages in its
    subscription, and closing the connection waited nats-py's 30 s drain for them."""
    b = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test")
    await b.ensure()
    subject = b.names.node_install("gpu-01")
    for i in range(20):
        await b.publish(subject, progress(f"step {i}"))
    sub = await b.js.subscribe(subject, ordered_consumer=True)
    first = await sub.next_msg(timeout=5)
    assert first.data
    await eventually(lambda: sub.pending_msgs > 0, timeout=5)
    started = anyio.current_time()
    await b.close()
    assert anyio.current_time() - started < 10
    assert b.conn.nc.is_closed
