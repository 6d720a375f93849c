"""Validation every adapter shares. Each rule returns the operator's sentence."""

from __future__ import annotations

from typing import NamedTuple

from ..events import GPUInfo, Profile, ShardSpec
from ..sources import SourceError
from ._quant import MIN_CAPABILITY, format_capability, parse_capability, quantization_of


class Problem(NamedTuple):
    """One problem with running a profile, as fields: what it is about (`profile chat`,
    `shard r1-0`) and the words that say what is wrong. Its text is `<about>: <words>`;
    a reader that quotes the problem within its own sentence (placement's refusal of a
    node, which names the profile already) takes the words."""

    about: str
    words: str

    def __str__(self) -> str:
        return f"{self.about}: {self.words}"


def validate_profile(
    profile: Profile,
    gpus: list[GPUInfo],
    shard: ShardSpec | None = None,
    *,
    requires_gpus: bool = True,
) -> list[str]:
    """Every problem with running `profile` on these GPUs, not just the first, in words.

    `requires_gpus=False` is for engines that also run on CPUs (llama.cpp, sim):
    a profile of theirs that names no GPU class asks for no GPUs.
    """
    return [str(p) for p in profile_problems(profile, gpus, shard, requires_gpus=requires_gpus)]


def profile_problems(
    profile: Profile,
    gpus: list[GPUInfo],
    shard: ShardSpec | None = None,
    *,
    requires_gpus: bool = True,
) -> list[Problem]:
    """`validate_profile`'s problems as values."""
    errors: list[Problem] = []

    def of_profile(words: str) -> None:
        errors.append(Problem(f"profile {profile.name}", words))

    def of_shard(words: str) -> None:
        errors.append(Problem(f"shard {shard.shard if shard is not None else ''}", words))

    try:
        source = profile.source
    except SourceError as exc:
        of_profile(exc.words)
        source = None
    else:
        if source is None and not profile.model_path.strip():
            of_profile(
                "model_path is empty; set it to the weights' path, "
                "or set model to hf://<org>/<repo>[/<file>], https://… (with model_sha256) or file:///path"
            )
    if profile.tp < 1:
        of_profile(f"tp must be positive, got {profile.tp}")
    if profile.pp < 1:
        of_profile(f"pp must be positive, got {profile.pp}")
    if profile.nodes < 1:
        of_profile(f"nodes must be positive, got {profile.nodes}")
    if profile.nodes > 1 and profile.gpus_per_node is None:
        of_profile(f"gpus_per_node is required when nodes > 1 (nodes is {profile.nodes})")
    elif profile.nodes > 1 and profile.gpus_per_node is not None and profile.gpus_per_node <= 0:
        # Zero GPUs per node would place a multi-node replica on no GPUs at all.
        of_profile(
            f"gpus_per_node must be positive when nodes > 1, "
            f"got {profile.gpus_per_node} (nodes is {profile.nodes})"
        )
    per_node = profile.per_node_gpus
    shape_known = profile.tp >= 1 and profile.pp >= 1 and profile.nodes >= 1
    if (
        shape_known
        and profile.per_node_gpus > 0
        and profile.nodes * profile.per_node_gpus != profile.tp * profile.pp
    ):
        of_profile(
            f"{profile.nodes} nodes x {profile.per_node_gpus} GPUs "
            f"does not match TP {profile.tp} x PP {profile.pp}"
        )
    if not requires_gpus and not profile.gpu_class and not (shard and shard.gpus):
        per_node = 0
    if per_node > 0 and len(gpus) < per_node:
        of_profile(f"needs {per_node} GPUs per node, node has {len(gpus)}")
    chosen = gpus
    if shard is not None and shard.gpus:
        by_index = {g.index: g for g in gpus}
        missing = [i for i in shard.gpus if i not in by_index]
        if missing:
            of_shard(
                f"GPU {', '.join(map(str, missing))} not on this node (this node's GPUs: {_indices(gpus)})"
            )
        if per_node > 0 and len(shard.gpus) != per_node:
            of_shard(f"given {len(shard.gpus)} GPUs, profile {profile.name} needs {per_node} per node")
        chosen = [by_index[i] for i in shard.gpus if i in by_index]
    used = chosen[:per_node] if per_node > 0 else chosen
    names = sorted({g.name for g in used})
    if len(names) > 1:
        of_profile(f"a tensor-parallel group may not mix GPU types ({', '.join(names)})")
    method = quantization_of(profile.args)
    need = MIN_CAPABILITY.get(method or "")
    if method and need is not None:
        for gpu in used:
            have = parse_capability(gpu.compute_capability)
            if have is not None and have < need:
                of_profile(
                    f"{method} needs compute capability "
                    f"{format_capability(need)}, GPU {gpu.index} ({gpu.name}) has "
                    f"{format_capability(have)}"
                )
    if shard is not None and profile.nodes > 1 and not shard.fabric:
        of_profile(
            f"a {profile.nodes}-node profile needs a fabric; shard {shard.shard} was placed without one"
        )
    if shard is not None and profile.nodes > 1 and shard.world != profile.nodes:
        of_profile(f"{profile.nodes} nodes needed, shard {shard.shard} lists {shard.world} members")
    return errors


def _indices(gpus: list[GPUInfo]) -> str:
    return ", ".join(str(g.index) for g in gpus) or "none"
