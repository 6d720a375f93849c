"""The environment every shard process gets, built from plain data."""

from __future__ import annotations

from collections.abc import Mapping

from ..events import ShardSpec


def generated_env(shard: ShardSpec) -> dict[str, str]:
    """The variables llmgw sets for a shard, before the profile's own env."""
    # Pin the shard to its GPUs, and set it even when there are none: an
    # empty list hides every GPU. Unset, a CPU replica on a GPU node (a CUDA
    # build of llama.cpp with -ngl 999) takes GPUs that placement counts as
    # free, and two shards on one node fight over the same memory.
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in shard.gpus)}
    if shard.hcas:
        # NCCL_IB_HCA lists only the chosen fabric's adapters. Leaving it
        # unset lets NCCL pick adapters from another fabric, where the peer
        # is unreachable, and the job hangs instead of failing. IB is enabled
        # explicitly: an NCCL_IB_DISABLE=1 inherited from the agent's own
        # environment would otherwise send the traffic over sockets.
        env["NCCL_IB_HCA"] = ",".join(shard.hcas)
        env["NCCL_IB_DISABLE"] = "0"
    else:
        # No InfiniBand for this shard (one node, or a fabric without HCAs):
        # NCCL must not probe verbs devices that lead nowhere.
        env["NCCL_IB_DISABLE"] = "1"
    if shard.mgmt_iface:
        # Bootstrap over the management interface, on one node too; NCCL and
        # Gloo otherwise pick the first interface they find (docker0, an IPoIB
        # port that does not route between fabrics) and the first all-reduce
        # hangs.
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
