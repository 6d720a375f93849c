"""vLLM's KV events as the launcher reads them: decoded as hostile bytes, kept per replica, and
relayed into the routing bucket, where a gateway takes them in place of what it routed.

The recorded batch is vLLM 0.32.0's own encoding (`KVEventBatch` of a `BlockStored`, a
`BlockRemoved` and an `AllBlocksCleared`, by `msgspec.msgpack.Encoder` as its publisher
does), so the decoder is checked against the engine's bytes without importing vLLM.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.engines import VLLM
from llmgw_core.events import Profile, ShardSpec
from llmgw_core.prefixes import RoutingHeld, pack, token_block_hash, token_seed
from llmgw_gateway import Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.prefix_share import Sharing
from llmgw_launcher.kv_events import (
    MAX_MESSAGE_BYTES,
    EngineBlocks,
    KVEventError,
    decode,
)
from llmgw_launcher.kv_relay import KVRelay, wanted
from tests.waiting import eventually

# Plain functions over plain data, but the relay's test (a real ZMQ socket and bus): the fast tier.
pytestmark = [pytest.mark.timeout(60)]

# vLLM 0.32.0: KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"\x01" * 32],
# parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None, medium="GPU",
# lora_name=None), BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"), AllBlocksCleared()],
# data_parallel_rank=0), as its ZMQ publisher encodes it.
RECORDED = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420"
    "0101010101010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f636b"
    "5f68617368c0a9746f6b656e5f696473dc0010000102030405060708090a0b0c0d0e0faa626c6f636b5f73697a"
    "6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f68617368657391c42001010101010101010101010101010101010101010101"
    "01010101010101010101a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
TOPIC = b"kv-events"


def frames(payload: bytes, seq: int = 0) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), payload]


def stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int = 4, **more: object
) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **more,
    }


def batch(*events: dict, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def chain(deployment: str, *blocks: list[int]) -> list[int]:
    out, prev = [], token_seed(deployment)
    for block in blocks:
        prev = token_block_hash(prev, block)
        out.append(prev)
    return out


def test_vllms_own_bytes_decode_and_each_event_is_honoured_in_order() -> None:
    message = decode(frames(RECORDED, seq=7))
    assert message.seq == 7
    assert [type(e).__name__ for e in message.batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    held = EngineBlocks("chat")
    only_stored = msgspec.msgpack.encode([1.5, [msgspec.msgpack.decode(RECORDED)[1][0]], 0])
    assert held.apply(decode(frames(only_stored, seq=0)))
    assert held.hashes() == chain("chat", list(range(16)))
    assert held.block_size == 16
    # The whole batch: stored, removed, cleared.
    assert not held.apply(decode(frames(RECORDED, seq=1))) or held.hashes() == []
    assert held.hashes() == []


def test_blocks_chain_from_their_parent_and_removals_and_clears_are_honoured() -> None:
    held = EngineBlocks("chat")
    held.apply(decode(frames(batch(stored([b"a", b"b"], None, [1, 2, 3, 4, 5, 6, 7, 8])))))
    held.apply(decode(frames(batch(stored([b"c"], b"b", [9, 10, 11, 12])), seq=1)))
    assert held.hashes() == chain("chat", [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    # The same tokens on another deployment hash apart.
    assert chain("other", [1, 2, 3, 4])[0] != held.hashes()[0]
    held.apply(
        decode(frames(batch({"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"}), seq=2))
    )
    assert held.hashes() == [
        chain("chat", [1, 2, 3, 4])[0],
        chain("chat", [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])[2],
    ]
    # A child of a block this relay never saw: dropped, counted (its prefix is unknown).
    held.apply(decode(frames(batch(stored([b"e"], b"zz", [1, 1, 1, 1])), seq=3)))
    assert held.dropped == {"orphan": 1}
    # A salted block: its tokens alone do not name it.
    held.apply(decode(frames(batch(stored([b"g"], None, [1, 2, 3, 4], extra_keys=[["salt"]])), seq=4)))
    # Token ids that are not whole blocks: that event alone.
    held.apply(decode(frames(batch(stored([b"h"], None, [1, 2, 3])), seq=5)))
    assert held.dropped == {"orphan": 1, "keyed": 1, "malformed": 1}
    assert len(held.hashes()) == 2
    # A LoRA's block is kept, chained from the adapter's seed (tests/test_kv_events_lora.py).
    held.apply(decode(frames(batch(stored([b"f"], None, [1, 2, 3, 4], lora_name="ad")), seq=6)))
    assert len(held.hashes()) == 3
    # A missed batch is counted.
    held.apply(decode(frames(batch({"type": "AllBlocksCleared"}), seq=9)))
    assert (held.hashes(), held.gaps) == ([], 1)
    # The engine started again (its sequence from 0): what the old one held is gone.
    held.apply(decode(frames(batch(stored([b"a"], None, [1, 2, 3, 4])), seq=10)))
    assert held.apply(decode(frames(batch(), seq=0)))
    assert (held.hashes(), held.gaps) == ([], 1)


def test_a_replica_holds_at_most_its_capacity_oldest_forgotten_first() -> None:
    held = EngineBlocks("chat", capacity=3)
    tokens = list(range(4 * 5))
    held.apply(decode(frames(batch(stored([bytes([i]) for i in range(5)], None, tokens)))))
    assert held.hashes() == chain("chat", *(tokens[i : i + 4] for i in range(0, 20, 4)))[2:]


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ([TOPIC, b"\0" * 8], "2 frames, not 3"),
        ([TOPIC, b"\0" * 7, RECORDED], "sequence of 7 bytes"),
        ([b"t" * 300, b"\0" * 8, RECORDED], "topic of 300 bytes"),
        (frames(b"\x93" + b"\0" * (MAX_MESSAGE_BYTES)), "at most"),
        (frames(batch(stored([b"x" * 65], None, [1, 2, 3, 4]))), "$[1][0].block_hashes[0]"),
        (frames(batch(stored([b"x"], None, [1, 2, 3, 1 << 32]))), "token_ids[3]"),
        (frames(batch(stored([b"x"], None, [1, 2, 3, 4], size=0))), "block_size"),
        (frames(batch({"type": "Unheard"})), "Invalid value 'Unheard'"),
        (frames(b"\xc1"), "payload"),
    ],
)
def test_a_message_past_a_bound_is_refused_by_name(message: list[bytes], says: str) -> None:
    with pytest.raises(KVEventError, match=None) as refused:
        decode(message)
    assert says in str(refused.value), str(refused.value)


FUZZ = settings(max_examples=100, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
token = st.integers(min_value=-2, max_value=(1 << 32) + 1)
# Any int msgpack can carry (int64 or uint64).
msgpack_int = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
hashes = st.lists(st.one_of(st.binary(max_size=70), msgpack_int), max_size=4)
event = st.one_of(
    st.builds(
        lambda h, p, t, s: stored(h, p, t, size=s),
        hashes,
        st.one_of(st.none(), st.binary(max_size=4)),
        st.lists(token, max_size=16),
        st.integers(min_value=-1, max_value=8),
    ),
    st.builds(lambda h: {"type": "BlockRemoved", "block_hashes": h, "medium": None}, hashes),
    st.just({"type": "AllBlocksCleared"}),
    st.dictionaries(st.text(max_size=4), msgpack_int, max_size=2),
)


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=5))
def test_any_frames_decode_or_are_refused_by_name(message: list[bytes]) -> None:
    with contextlib.suppress(KVEventError):
        decode(message)


@FUZZ
@given(st.lists(st.lists(event, max_size=4), max_size=3), st.data())
def test_any_events_are_kept_bounded_or_refused_never_fatal(
    batches: list[list[dict]], data: st.DataObject
) -> None:
    held = EngineBlocks("chat", capacity=8)
    for seq, events in enumerate(batches):
        payload = batch(*events)
        if data.draw(st.booleans()):
            # A byte of it flipped.
            at = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
            payload = payload[:at] + bytes([payload[at] ^ 0xFF]) + payload[at + 1 :]
        try:
            message = decode(frames(payload, seq))
        except KVEventError:
            continue
        held.apply(message)
        assert len(held.hashes()) <= 8
        assert all(0 <= h < 1 << 64 for h in held.hashes())


def test_a_gateway_takes_the_engines_word_in_place_of_what_it_routed() -> None:
    table = Table(routing=RoutingConfig(replica_blocks=4))
    for r in ("r0", "r1"):
        table.set_replica(f"chat.{r}", _ready_record(r))
    state = Sharing(table, "gw-a")
    table.pick("chat", blocks=(1, 2, 3, 4, 5))
    [routed_to] = [k for k in table.prefixes.replicas() if table.prefixes.size(k)]
    engine = RoutingHeld(
        gateway="launcher-n1", blocks=pack([11, 12, 13, 14, 15, 16]), at=2.0, source="engine", block_tokens=16
    )
    assert state.read(routed_to, engine, now=2.0) == "learned"
    # Bounded as any value: the newest `replica_blocks`.
    assert state.engine[routed_to].hashes() == [13, 14, 15, 16]
    # The replica's key is its launcher's now: routing there writes nothing over it.
    table.pick("chat", blocks=(1, 2, 3, 4, 5))
    puts, _ = state.writes(now=3.0)
    assert routed_to not in [k for k, _ in puts]
    # Another gateway's routed value does not displace it; a clear (an empty value) is taken.
    state.read(routed_to, RoutingHeld(gateway="gw-b", blocks=pack([99]), at=3.0), now=3.0)
    assert state.engine[routed_to].hashes() == [13, 14, 15, 16]
    state.read(
        routed_to, RoutingHeld(gateway="launcher-n1", at=4.0, source="engine", block_tokens=16), now=4.0
    )
    assert state.engine[routed_to].hashes() == []
    # The replica gone: forgotten with it.
    table.set_replica(routed_to, None)
    assert routed_to not in state.engine


def _ready_record(replica: str) -> object:
    from llmgw_core.events import ReplicaRecord

    return ReplicaRecord(
        deployment="chat",
        replica=replica,
        profile="tiny",
        profile_fp="fp",
        state="ready",
        url=f"http://127.0.0.1:1/{replica}",
    )


@contextlib.contextmanager
def publisher(port: int) -> Iterator[zmq.Socket]:
    """vLLM's side: a PUB socket that connects to where the relay listens."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_shard(port: int) -> ShardSpec:
    profile = Profile(name="tiny", engine="vllm", model_path="/m", kv_events=True)
    return ShardSpec(
        replica="r0",
        shard="chat-r0-0",
        node="n1",
        profile=profile,
        deployment="chat",
        host="127.0.0.1",
        port=port + 1,
        extra_ports=(port,),
    )


@pytest.mark.anyio
async def test_the_relay_writes_what_the_engine_holds_to_the_routing_bucket_and_survives_garbage(
    bus: Bus,
) -> None:
    port = free_port()
    with publisher(port) as pub:
        relay = KVRelay(bus, "launcher-n1", lambda: {"n1.chat-r0-0": kv_shard(port)}, interval_s=0.05)
        async with anyio.create_task_group() as tg:
            await tg.start(relay.run)

            async def value() -> RoutingHeld:
                found = await bus.get(bus.names.routing_bucket, "chat.r0", RoutingHeld)
                assert found is not None
                return found[0]

            async def holds(expected: list[int]) -> RoutingHeld:
                # PUB drops what it sends before the subscriber joined: send until it lands.
                pub.send_multipart(frames(payload, next(seqs)))
                got = await value()
                assert got.hashes() == expected, got
                return got

            seqs = iter(range(10_000))
            payload = batch(stored([b"a", b"b"], None, [1, 2, 3, 4, 5, 6, 7, 8]))
            got = await eventually(
                lambda: holds(chain("chat", [1, 2, 3, 4], [5, 6, 7, 8])), timeout=20, interval=0.1
            )
            assert (got.source, got.gateway, got.block_tokens) == ("engine", "launcher-n1", 4)
            # Garbage, then too many frames: each dropped and counted; the relay reads on.
            pub.send_multipart([TOPIC, b"\0" * 8, b"\xc1"])
            pub.send_multipart([TOPIC, b"\0" * 8, RECORDED, b"more"])
            payload = batch({"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"})
            await eventually(lambda: holds(chain("chat", [1, 2, 3, 4])), timeout=20, interval=0.1)
            [followed] = relay.followed.values()
            assert followed.refused == 2, followed
            payload = batch({"type": "AllBlocksCleared"})
            await eventually(lambda: holds([]), timeout=20, interval=0.1)
            # The shard gone: its subscription ends.
            relay.shards = dict
            await eventually(lambda: not relay.followed, timeout=5)
            tg.cancel_scope.cancel()


def test_a_kv_events_profile_gets_a_port_and_vllm_connects_its_publisher_there() -> None:
    adapter = VLLM()
    spec = kv_shard(20007)
    assert adapter.extra_ports(msgspec.structs.replace(spec, extra_ports=())) == 1
    [command] = adapter.commands(spec)
    at = command.args.index("--kv-events-config")
    assert command.args[at - 1] == "--enable-prefix-caching"
    config = json.loads(command.args[at + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # The node's own address, not a wildcard: vLLM connects to it, the launcher listens.
        "endpoint": "tcp://127.0.0.1:20007",
        "topic": "kv-events",
    }
    # A profile that does not ask: no port, no flags.
    plain = msgspec.structs.replace(spec, profile=msgspec.structs.replace(spec.profile, kv_events=False))
    assert adapter.extra_ports(plain) == 0
    assert "--kv-events-config" not in adapter.commands(plain)[0].args
    assert wanted({"s": plain}) == {}
    assert wanted({"s": spec}) == {"s": ("chat.r0", "tcp://127.0.0.1:20007")}
