"""The environment every shard process gets, built from plain data."""

from __future__ import annotations

from collections.abc import Mapping

from ._types import ShardSpec


def generated_env(shard: ShardSpec) -> dict[str, str]:
    """The variables llmgw sets for a shard, before the profile's own env."""
    env: dict[str, str] = {}
    if shard.gpus:
        # Pin the shard to its GPUs; without it every engine grabs GPU 0 and
        # two shards on one node fight over the same memory.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in shard.gpus)
    if shard.world > 1:
        if shard.hcas:
            # NCCL_IB_HCA lists only the chosen fabric's adapters. Leaving it
            # unset lets NCCL pick adapters from another fabric, where the peer
            # is unreachable, and the job hangs instead of failing.
            env["NCCL_IB_HCA"] = ",".join(shard.hcas)
        else:
            # No InfiniBand for this shard: NCCL must use sockets instead of
            # probing verbs devices that lead nowhere.
            env["NCCL_IB_DISABLE"] = "1"
        if shard.mgmt_iface:
            # Bootstrap over the management interface; NCCL and Gloo otherwise
            # pick the first interface they find (docker0, an IB port) and the
            # rendezvous times out.
            env["NCCL_SOCKET_IFNAME"] = shard.mgmt_iface
            env["GLOO_SOCKET_IFNAME"] = shard.mgmt_iface
    return env


def materialise(
    environ: Mapping[str, str] | None,
    generated: Mapping[str, str],
    profile_env: Mapping[str, str],
) -> tuple[tuple[str, str], ...]:
    """The complete environment: inherited, then generated, then the profile's (which wins).

    Sorted so that the same inputs give the same bytes: golden tests and the
    launcher's change detection both depend on it.
    """
    env = dict(environ or {})
    env.update(generated)
    env.update(profile_env)
    return tuple(sorted(env.items()))
