"""Placement's writes when NATS's answers are lost: what lands without an answer is not left
in the buckets behind placement's back."""

from __future__ import annotations

import msgspec
import pytest

from llmgw_core.bus import Bus, BusOptions, batch
from llmgw_core.errors import BusError
from llmgw_core.events import ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_placement.apply import Applier
from llmgw_placement.config import ServerConfig
from llmgw_placement.held import Held, key
from llmgw_placement.index import KeptIndex
from llmgw_placement.liveness import Liveness
from llmgw_placement.plan import Plan, Save
from llmgw_placement.state import ClusterState
from tests.nats_link import nats_link
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_a_change_of_state_whose_commit_landed_unanswered_is_written_again_as_placement_holds_it(
    own_nats: NatsServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step drains a replica; its commit lands but every try's answer is lost, so the step
    fails and placement never took the drain in memory (the replica serves on). Regression: the bucket
    kept `draining`, so gateways sent the replica nothing while placement counted it ready,
    until the replica next changed. The next flush writes placement's record again."""
    # Three tries of the commit, each waiting this long for its lost answer.
    monkeypatch.setattr(batch, "COMMIT_TIMEOUT_S", 1.0)
    async with (
        nats_link(own_nats.port) as link,
        await Bus.connect(BusOptions(url=own_nats.url, prefix=prefix, insecure=True), service="test") as bus,
        await Bus.connect(
            BusOptions(url=link.url, prefix=prefix, insecure=True), service="placement"
        ) as lossy,
    ):
        await bus.ensure()
        bucket = bus.names.replicas_bucket
        held = Held()
        config, state = ServerConfig(), ClusterState.empty()
        applier = Applier(config, lossy, held, KeptIndex(config, state, Liveness(config, state)))
        ready = ReplicaRecord(
            deployment="chat",
            replica="r0",
            profile="tiny",
            profile_fp="fp",
            state="ready",
            url="http://10.0.0.1:8000",
        )
        k = key(ready)

        async def stored() -> ReplicaRecord:
            found = await bus.get(bucket, k, ReplicaRecord)
            assert found is not None
            return found[0]

        held.replicas[k] = ready
        plan = Plan()
        plan.saves.append(Save(None, ready, ""))
        await applier.flush(plan)
        assert await stored() == ready

        draining = msgspec.structs.replace(ready, state="draining", reason="draining: scaled down")
        plan.saves.append(Save(ready, draining, ""))
        link.lose_answers_after(f"$KV.{bucket}.{k}", deaf_s=60)
        with pytest.raises(BusError, match=f"a write to \\$KV.{bucket}.{k} failed"):
            await applier.flush(plan)
        assert link.lost.is_set()
        # Not taken in memory (its commit was not acknowledged); the bucket has what landed.
        assert held.replicas[k] is ready
        assert await stored() == draining
        assert held.rewrite == {k}

        link.cut_now()
        await link.cut.wait()

        async def flushed() -> bool:
            # As placement's next steps would: tried again until NATS answers.
            try:
                await applier.flush(Plan())
            except BusError as exc:
                raise AssertionError(exc) from exc
            return True

        # Nothing else to write: the record is written again as placement holds it.
        await eventually(flushed, timeout=30)
        assert await stored() == ready
        assert held.rewrite == set()
        # Written once: the next flush has nothing to write.
        writes = applier.writes
        await applier.flush(Plan())
        assert applier.writes == writes
