"""Validation every adapter shares. Each rule returns the operator's sentence."""

from __future__ import annotations

from ..events import GPUInfo, Profile, ShardSpec
from ..sources import SourceError, parse_source
from ._quant import MIN_CAPABILITY, format_capability, parse_capability, quantization_of


def validate_profile(
    profile: Profile,
    gpus: list[GPUInfo],
    shard: ShardSpec | None = None,
    *,
    requires_gpus: bool = True,
) -> list[str]:
    """Every problem with running `profile` on these GPUs, not just the first.

    `requires_gpus=False` is for engines that also run on CPUs (llama.cpp, sim):
    a profile of theirs that names no GPU class asks for no GPUs.
    """
    errors: list[str] = []
    try:
        source = parse_source(profile.model, profile.model_sha256, profile=profile.name)
    except SourceError as exc:
        errors.append(str(exc))
        source = None
    else:
        if source is None and not profile.model_path.strip():
            errors.append(
                f"profile {profile.name}: model_path is empty; set it to the weights' path, "
                "or set model to hf://<org>/<repo>[/<file>], https://… (with model_sha256) or file:///path"
            )
    if profile.tp < 1:
        errors.append(f"profile {profile.name}: tp must be positive, got {profile.tp}")
    if profile.pp < 1:
        errors.append(f"profile {profile.name}: pp must be positive, got {profile.pp}")
    if profile.nodes < 1:
        errors.append(f"profile {profile.name}: nodes must be positive, got {profile.nodes}")
    if profile.nodes > 1 and profile.gpus_per_node is None:
        errors.append(
            f"profile {profile.name}: gpus_per_node is required when nodes > 1 (nodes is {profile.nodes})"
        )
    elif profile.nodes > 1 and profile.gpus_per_node is not None and profile.gpus_per_node <= 0:
        # Zero GPUs per node would place a multi-node replica on no GPUs at all.
        errors.append(
            f"profile {profile.name}: gpus_per_node must be positive when nodes > 1, "
            f"got {profile.gpus_per_node} (nodes is {profile.nodes})"
        )
    per_node = profile.per_node_gpus
    shape_known = profile.tp >= 1 and profile.pp >= 1 and profile.nodes >= 1
    if (
        shape_known
        and profile.per_node_gpus > 0
        and profile.nodes * profile.per_node_gpus != profile.tp * profile.pp
    ):
        errors.append(
            f"profile {profile.name}: {profile.nodes} nodes x {profile.per_node_gpus} GPUs "
            f"does not match TP {profile.tp} x PP {profile.pp}"
        )
    if not requires_gpus and not profile.gpu_class and not (shard and shard.gpus):
        per_node = 0
    if per_node > 0 and len(gpus) < per_node:
        errors.append(f"profile {profile.name}: needs {per_node} GPUs per node, node has {len(gpus)}")
    chosen = gpus
    if shard is not None and shard.gpus:
        by_index = {g.index: g for g in gpus}
        missing = [i for i in shard.gpus if i not in by_index]
        if missing:
            errors.append(
                f"shard {shard.shard}: GPU {', '.join(map(str, missing))} not on this node "
                f"(this node's GPUs: {_indices(gpus)})"
            )
        if per_node > 0 and len(shard.gpus) != per_node:
            errors.append(
                f"shard {shard.shard}: given {len(shard.gpus)} GPUs, "
                f"profile {profile.name} needs {per_node} per node"
            )
        chosen = [by_index[i] for i in shard.gpus if i in by_index]
    used = chosen[:per_node] if per_node > 0 else chosen
    names = sorted({g.name for g in used})
    if len(names) > 1:
        errors.append(
            f"profile {profile.name}: a tensor-parallel group may not mix GPU types ({', '.join(names)})"
        )
    method = quantization_of(profile.args)
    need = MIN_CAPABILITY.get(method or "")
    if method and need is not None:
        for gpu in used:
            have = parse_capability(gpu.compute_capability)
            if have is not None and have < need:
                errors.append(
                    f"profile {profile.name}: {method} needs compute capability "
                    f"{format_capability(need)}, GPU {gpu.index} ({gpu.name}) has "
                    f"{format_capability(have)}"
                )
    if shard is not None and profile.nodes > 1 and not shard.fabric:
        errors.append(
            f"profile {profile.name}: a {profile.nodes}-node profile needs a fabric; "
            f"shard {shard.shard} was placed without one"
        )
    if shard is not None and profile.nodes > 1 and shard.world != profile.nodes:
        errors.append(
            f"profile {profile.name}: {profile.nodes} nodes needed, shard {shard.shard} "
            f"lists {shard.world} members"
        )
    return errors


def _indices(gpus: list[GPUInfo]) -> str:
    return ", ".join(str(g.index) for g in gpus) or "none"
