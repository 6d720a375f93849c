"""One node id, one machine, as pure decisions: who claims a node, a launcher's statuses
against what it runs, and where the gateway sends while a launcher restarts."""

from __future__ import annotations

from llmgw_core.claims import Claimant, Claims, Holder
from llmgw_core.events import Heartbeat, ReplicaRecord, ShardStatus
from llmgw_gateway import Table
from llmgw_launcher.audit import Corrections, audit


def claimant(host: str, pid: int, instance: str, started_at: float = 0.0, boot: str = "") -> Claimant:
    return Claimant(host=host, boot_id=boot or BOOTS[host], pid=pid, instance=instance, started_at=started_at)


BOOTS = {"host-a": "1a2b3c4d-0000-4000-8000-000000000000", "host-b": "5e6f7a8b-0000-4000-8000-000000000000"}
A = claimant("host-a", 100, "a1", started_at=1.0)
B = claimant("host-b", 200, "b1", started_at=2.0)


def test_a_restart_is_not_a_second_claim_but_two_senders_are() -> None:
    claims = Claims(window=5.0)
    at = 0.0
    for _ in range(5):
        assert not claims.beat(A.beat("n1", "launcher"), "n1", "launcher", at)
        at += 1.0
    # The launcher restarts: a new instance, the old one never beats again.
    restarted = claimant("host-a", 101, "a2", started_at=at)
    for _ in range(5):
        assert not claims.beat(restarted.beat("n1", "launcher"), "n1", "launcher", at)
        at += 1.0
    assert claims.claimed("n1", at) is None
    assert claims.contested(at) == []

    # A second machine starts sending: the first beat could be a restart, the old one's next is not.
    assert not claims.beat(B.beat("n1", "launcher"), "n1", "launcher", at)
    assert claims.beat(restarted.beat("n1", "launcher"), "n1", "launcher", at + 0.1), "told once"
    assert not claims.beat(B.beat("n1", "launcher"), "n1", "launcher", at + 0.2)
    assert not claims.beat(restarted.beat("n1", "launcher"), "n1", "launcher", at + 0.3)
    # The one that started first comes first.
    assert claims.claimed("n1", at + 0.3) == (
        "n1 is claimed by two machines: host-b (boot 5e6f7a8b) with launcher pid 200, and "
        "host-a (boot 1a2b3c4d) with launcher pid 101"
    )
    assert claims.contested(at + 0.3) == ["n1"]
    # The second machine stops: once it has been silent for the window, the node is one machine's.
    for step in range(1, 8):
        claims.beat(restarted.beat("n1", "launcher"), "n1", "launcher", at + 0.3 + step)
    assert claims.claimed("n1", at + 7.3) is None
    assert claims.contested(at + 7.3) == []


def test_two_agents_on_one_machine_and_agents_that_do_not_say_who_they_are() -> None:
    claims = Claims(window=5.0)
    other = claimant("host-a", 300, "a9", started_at=5.0, boot=A.boot_id)
    for i in range(3):
        claims.beat(A.beat("n1", "installer"), "n1", "installer", i)
        claims.beat(other.beat("n1", "installer", standby=True), "n1", "installer", i + 0.5)
    assert claims.claimed("n1", 3.0) == (
        "n1 is claimed twice on one machine, host-a (boot 1a2b3c4d), with installer pid 100, "
        "installer pid 300 (standing by)"
    )
    # An older agent's beat names nobody: never a claim.
    old = Claims(window=5.0)
    for i in range(4):
        assert not old.beat(Heartbeat(node="n2", service="launcher", at=0.0), "n2", "launcher", i)
    assert old.claimed("n2", 4.0) is None


def test_an_agent_stands_by_while_another_instance_works_for_its_node() -> None:
    holder = Holder("n1", "launcher", 1.0, B)
    assert holder.must_wait(0.0) is None, "nobody else heard: work"
    holder.heard(B.beat("n1", "launcher"), 0.1)  # its own beat
    assert holder.must_wait(0.2) is None
    holder.heard(A.beat("n1", "launcher"), 0.5)
    why = holder.must_wait(0.6)
    assert why == (
        "n1 is claimed by two machines: host-a (boot 1a2b3c4d) with launcher pid 100, and host-b "
        "(boot 5e6f7a8b) with launcher pid 200 (standing by); this launcher stands by and runs "
        "nothing until the other has been silent for 5 s: stop one of them, or give this machine a "
        "node id of its own"
    )
    # A standby elsewhere is no reason to wait; a worker silent for the takeover time neither.
    holder.heard(A.beat("n1", "launcher", standby=True), 1.0)
    assert holder.must_wait(1.1) is None
    holder.heard(A.beat("n1", "launcher"), 2.0)
    assert holder.must_wait(6.9) is not None
    assert holder.must_wait(7.1) is None


def status(shard: str, state: str = "ready", port: int = 20001, at: float = 1.0) -> ShardStatus:
    return ShardStatus(node="n1", shard=shard, replica="r0", state=state, port=port, at=at)  # type: ignore[arg-type]


def test_the_launcher_corrects_statuses_that_are_not_what_it_runs_when_seen_twice() -> None:
    mine = {"n1.s1": status("s1"), "n1.s2": status("s2", port=20002), "n1.s3": None}
    other_machine = status("s2", port=29999, at=2.0)
    stored = {
        "n1.s1": status("s1"),  # what it runs
        "n1.s2": other_machine,  # ready at a port no engine of its own holds
        "n1.s3": status("s3", "starting"),  # adopted, not checked yet: its runner said nothing
        "n1.gone": status("gone"),  # a shard it does not run
    }
    fix, suspects = audit(stored, mine, {})
    assert not fix, "a first sighting may be a status still on its way"
    assert suspects == {"n1.s2": other_machine, "n1.gone": status("gone")}
    fix, suspects = audit(stored, mine, suspects)
    assert fix == Corrections(rewrite=("n1.s2",), remove=("n1.gone",))
    assert suspects == {}
    # A status of its own missing from the bucket is written again too.
    fix, suspects = audit({}, {"n1.s1": status("s1")}, {"n1.s1": None})
    assert fix == Corrections(rewrite=("n1.s1",))
    # A stored value that changed between two audits is a new suspect, not yet a correction.
    fix, suspects = audit(
        {"n1.s1": status("s1"), "n1.s2": status("s2", port=1)}, mine, {"n1.s2": other_machine}
    )
    assert not fix
    assert suspects == {"n1.s2": status("s2", port=1)}


def record(replica: str, state: str, url: str = "") -> ReplicaRecord:
    return ReplicaRecord(
        deployment="chat",
        replica=replica,
        profile="tiny",
        profile_fp="fp",
        state=state,  # type: ignore[arg-type]
        url=url,
    )


def test_the_gateway_sends_to_a_replica_of_unknown_readiness_only_when_none_is_ready() -> None:
    table = Table()
    table.set_replica("chat.r0", record("r0", "unknown", "http://10.0.0.1:20001"))
    table.set_replica("chat.r1", record("r1", "ready", "http://10.0.0.2:20001"))
    table.set_replica("chat.r2", record("r2", "unknown"))  # it was not serving when last heard
    assert [table.pick("chat")[0] for _ in range(3)] == ["chat.r1"] * 3  # type: ignore[index]
    # r1 refused the connection: the one whose engines were last heard ready takes it.
    picked = table.pick("chat", frozenset({"chat.r1"}))
    assert picked is not None
    assert picked[0] == "chat.r0"
    assert table.pick("chat", frozenset({"chat.r1", "chat.r0"})) is None
    assert [k for k, _ in table.ready("chat")] == ["chat.r1"], "counted ready: only the ready one"
