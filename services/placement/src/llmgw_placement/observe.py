"""What a held replica's shards and node say of it now: pure functions of one step's snapshot.

`observe` reads a replica's state from its shards' statuses; `gpus_gone` says why a replica
is to be placed again because its node no longer has its GPUs, and `node_unfit` why one
that failed for good is (its node is now unfit for its profile).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from llmgw_core import failures, fit
from llmgw_core.engines import ShardSpec
from llmgw_core.events import ModelShape, ReplicaRecord, ReplicaState

from .snapshot import Snapshot


def observe(record: ReplicaRecord, snap: Snapshot, at: float) -> ReplicaRecord | None:
    """A replica's state from its shards: ready only when every shard is and the leader answered.
    Its record changed, or None where nothing changed.

    A shard whose launcher has gone silent reported what it saw then, not
    now: the replica's readiness is `unknown` until the launcher is heard
    again (or the node is declared lost and the replica placed elsewhere).
    An `unknown` replica whose shards were last heard ready keeps its URL:
    the gateway sends to it when no replica is known ready, so a launcher
    restart (its engines serving on) costs no request.
    """
    liveness = snap.liveness
    statuses = [snap.shard_status.get(k) for k in record.shards]
    url = ""
    state: ReplicaState
    reason = ""
    failed = [s for s in statuses if s is not None and s.state == "failed"]
    silent = sorted({m.node for m in record.members if liveness.launcher_stale(m.node, at)})
    last_ready = bool(statuses) and all(
        s is not None and s.state == "ready" and s.profile_fp == record.profile_fp for s in statuses
    )
    if silent:
        state = "unknown"
        reason = f"launcher on {', '.join(silent)} silent: readiness unknown"
        if all(liveness.installer_beats(n, at) for n in silent):
            reason += (
                f"; its installer still beats (an agent restart?): its engines are routed to for up "
                f"to launcher_grace_s ({snap.config.launcher_grace_s:g} s) before it fails over"
            )
        if last_ready and statuses[0] is not None:
            url = statuses[0].url
    elif failed:
        state = "failed" if any(not s.retryable for s in failed) else "degraded"
        reason = "; ".join(f"{s.node}/{s.shard}: {failures.reason_line(s)}" for s in failed)
    elif last_ready:
        leader = statuses[0]
        assert leader is not None
        url = leader.url
        state = "ready" if url else "starting"
    else:
        state = "starting"
    # Restarts and the last failure, as the launchers keep them: the failure stays
    # until the replica is ready again, so a retry never hides why it is retrying.
    known = [s for s in statuses if s is not None]
    restarts = sum(s.restarts for s in known)
    last = max(known, key=lambda s: s.last_failure_at, default=None)
    last_failure = last.last_failure if last is not None and state != "ready" else ""
    failure = failures.failure_of(last) if last is not None and state != "ready" else None
    if state == "starting" and failure is not None:
        reason = failures.retrying(restarts + 1, failure)
    elif state == "starting":
        # What its shards wait for, in their nodes' words: the weights staging with its
        # progress (`n1: weights qwen@a1b2c3: downloading m.gguf (38%, 5.1 of 13.4 GB)`).
        reason = "; ".join(f"{s.node}: {s.reason}" for s in known if s.state == "waiting" and s.reason)
    if (state, reason, url, restarts, last_failure, failure) == (
        record.state,
        record.reason,
        record.url,
        record.restarts,
        record.last_failure,
        record.failure,
    ):
        return None
    return msgspec.structs.replace(
        record,
        state=state,
        reason=reason,
        url=url,
        restarts=restarts,
        last_failure=last_failure,
        failure=failure,
        since=record.since if state == record.state and record.since else snap.wall,
        updated_at=snap.wall,
    )


def replace_words(
    record: ReplicaRecord,
    shards: Mapping[str, ShardSpec],
    snap: Snapshot,
    shapes: Mapping[str, ModelShape],
    restart: str,
) -> str:
    """Why a replica is failed whatever its state and placed again, else "": a GPU its node no
    longer reports (a replacement machine with fewer GPUs under the same node id); a node now
    unfit for its profile by what it reported since (the model file it lacks, or a model shape
    the shard's GPUs cannot hold); or `restart`, the gateways' judgement of its answers held for
    `unhealthy_restart_s` (`judged.restart_words`). The decision then places it on a node that
    fits, or says every node's figures."""
    return gpus_gone(record, shards, snap) or node_unfit(record, shards, snap, shapes) or restart


def gpus_gone(record: ReplicaRecord, shards: Mapping[str, ShardSpec], snap: Snapshot) -> str:
    """Why a replica holds GPUs its node no longer reports, else "": `GPU 1 is no longer on
    node-a (it reports 1 GPU: 0)`. Whatever the replica's state: a node that came back with
    fewer GPUs (a card pulled, a replacement machine under the same id) left a replica pinned
    to GPU 1 `ready` by its last word, counted held on a GPU that is not there, and nothing
    said so. One still being written has nothing to check yet. A node that reports no GPU at
    all fails only the replicas already failed: a probe whose driver call failed once reads
    as no GPU, and would take every serving replica off a healthy node."""
    if record.state == "placing":
        return ""
    for k in record.shards:
        spec = shards.get(k)
        status = snap.nodes.get(spec.node) if spec is not None else None
        if spec is None or status is None:
            continue
        have = sorted(g.index for g in status.facts.gpus)
        if not have and record.state != "failed":
            continue
        missing = [i for i in spec.gpus if i not in have]
        if missing:
            plural, verb = ("s", "are") if len(missing) > 1 else ("", "is")
            return (
                f"GPU{plural} {', '.join(map(str, missing))} {verb} no longer on {spec.node} "
                f"(it reports {len(have)} GPU{'' if len(have) == 1 else 's'}"
                f"{': ' + ', '.join(map(str, have)) if have else ''})"
            )
    return ""


def node_unfit(
    record: ReplicaRecord, shards: Mapping[str, ShardSpec], snap: Snapshot, shapes: Mapping[str, ModelShape]
) -> str:
    """Why a replica that failed for good is on a node now unfit for its profile, else "":
    the node reports the model file missing (`node-b: model file not found: /models/x.gguf`),
    or the model's shape is known now and the GPUs the shard was given (for a CPU profile,
    the node's memory) cannot hold it, by the rule `unfit` applies (`gpu-a: needs ~41.2 GiB
    per GPU (…), L40S-48G has 44.5 GiB usable`)."""
    if record.state != "failed":
        return ""
    for k in record.shards:
        spec = shards.get(k)
        if spec is None:
            continue
        profile = spec.profile
        path = profile.node_file
        if path and path in snap.missing_models.get(spec.node, ()):
            return f"{spec.node}: model file not found: {path}"
        status = snap.nodes.get(spec.node)
        shape = shapes.get(profile.weights_key)
        if status is None or shape is None:
            continue
        gpus = [g for g in status.facts.gpus if g.index in spec.gpus]
        try:
            too_big = fit.check_shard(shape, profile, gpus, status.facts.memory_mb)
        except fit.FitError as exc:
            # A shape or a reported memory no estimate can use: placed again, the replica
            # is refused on every node in these words (`unfit` says the same).
            too_big = f"model {profile.weights_key or profile.model_path}: {exc}"
        if too_big:
            return f"{spec.node}: {too_big}"
    return ""
