"""Whether one node can take one rank of a profile, and in whose words it cannot; how well it fits.

`unfit` gives every refusal's reason for a node (a `Reason`: the words `ctl explain`
shows and the events carry, and their kind, which readers act on); `score` ranks the
nodes that fit. Both read a `NodeView` only, so the index (`index.py`) and the decision
(`decide.py`) judge a node alike.

`unfit` is total: a record it cannot use (a model's shape outside its bounds, a GPU
reporting impossible memory) refuses the node in words for that profile, and any other
fault in judging one node costs that node, never the decision or the step.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw_core import failures, fit
from llmgw_core.engines import GPUInfo, Profile, profile_problems
from llmgw_core.events import Deployment, EngineState, ModelShape, NodeReason

from .gpuclass import gpu_class

# How an operator names each engine, for the refusals that speak of its builds.
ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}

# How much of an unexpected error a refusal quotes: the rest is in the log.
WORDS_MAX = 300

log = logging.getLogger("llmgw.placement")

# The installer's progress while it works (`installing: downloading …`): the node's status
# carries its words only, so they are classed here, where the refusal is made.
_INSTALLING = re.compile(r"installing\b")


class Reason(str):
    """Why one node cannot take a rank: the operator's words (the string itself, so that every
    reader of the words reads them as before) and what refused the node (`kind`, one of
    `failures.REFUSAL_KINDS`) as a field, carried from where the refusal is made to where it
    is said (`NodeReason`), never read back out of the words."""

    kind: str

    def __new__(cls, words: str, kind: str) -> Reason:
        made = super().__new__(cls, words)
        made.kind = kind
        return made

    def __reduce__(self) -> tuple[type[Reason], tuple[str, str]]:
        return Reason, (str(self), self.kind)

    @classmethod
    def of(cls, reason: NodeReason) -> Reason:
        return cls(reason.reason, reason.kind)


def node_reason(node: str, reason: str) -> NodeReason:
    """One node's refusal as it travels: plain words (msgspec encodes no `str` subclass) and,
    from a `Reason`, its kind."""
    return NodeReason(node=node, reason=str(reason), kind=reason.kind if isinstance(reason, Reason) else "")


def fault_words(exc: BaseException) -> str:
    """An unexpected error as a refusal quotes it: its type and the start of its message (an
    error's text may hold a whole hostile value)."""
    try:
        text = str(exc)
    except Exception:  # a message that cannot even be made (a 10**5000 in it)
        text = ""
    text = text if len(text) <= WORDS_MAX else f"{text[:WORDS_MAX]}…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class NodeView:
    """What placement knows of one node."""

    node: str
    alive: bool = True
    lost_for_s: float = 0.0
    # When the node was last heard, as UTC wall-clock text: a refusal that quotes it
    # stays the same while the node stays lost, so it is published once, not every step.
    lost_since: str = ""
    pools: frozenset[str] = frozenset()
    fabric: str = ""
    gpus: tuple[GPUInfo, ...] = ()
    used_gpus: frozenset[int] = frozenset()
    engines: Mapping[str, EngineState] = field(default_factory=dict)
    install: str = ""
    avx2: bool = True
    hcas: tuple[str, ...] = ()
    weights: frozenset[str] = frozenset()
    mgmt_addr: str = "127.0.0.1"
    shards: int = 0
    used_ports: frozenset[int] = frozenset()
    replicas_of: Mapping[str, int] = field(default_factory=dict)
    mgmt_iface: str = ""
    # `n1 is claimed by two machines: …` while two machines send its heartbeats: nothing
    # more is placed on it (which of them would run it?).
    claimed: str = ""
    # `cordoned by ops at …: why` (or `draining by …`) while the operator keeps new replicas off it.
    cordoned: str = ""
    # The model files the node's launcher found missing (`Profile.node_file`): the profiles
    # that read them are placed elsewhere until the file is there.
    missing_models: frozenset[str] = frozenset()
    # The shape of every model any node reported (`NodeFacts.shapes`), by weights key: the
    # shape is the model's, so a node that never held it is fitted with it too.
    shapes: Mapping[str, ModelShape] = field(default_factory=dict)
    # The host's memory, for CPU profiles (0: not reported, not checked).
    memory_mb: int = 0
    # Weights keys of shards placed here that the node does not report holding yet: it is
    # staging them (or will, once its launcher sees the shard).
    coming: frozenset[str] = frozenset()
    # Why placement cannot use the node's status at all (`unusable_view`): nothing is
    # placed on it, and every refusal says so.
    unusable: str = ""

    # A view never changes once made: what is derived from it is computed once.
    _free: dict[str, list[GPUInfo]] = field(default_factory=dict, compare=False, repr=False)
    _classes: list[frozenset[str]] = field(default_factory=list, compare=False, repr=False)
    _counts: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _chosen: dict[tuple[str, int], list[GPUInfo]] = field(default_factory=dict, compare=False, repr=False)
    # unfit() per (profile fingerprint, deployment name, pool): the many replicas of one
    # deployment placed in a step meet the same unchanged views again and again.
    _unfit: dict[tuple[str, str, str], Reason | None] = field(default_factory=dict, compare=False, repr=False)
    # score() per (profile fingerprint, deployment name, strategy).
    _scores: dict[tuple[str, str, str], tuple[object, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def free_gpus(self, cls: str) -> list[GPUInfo]:
        found = self._free.get(cls)
        if found is None:
            found = [g for g in self.gpus if g.index not in self.used_gpus and gpu_class(g) == cls]
            self._free[cls] = found
        return found

    @property
    def classes(self) -> frozenset[str]:
        if not self._classes:
            self._classes.append(frozenset(gpu_class(g) for g in self.gpus))
        return self._classes[0]

    def count_of(self, cls: str) -> int:
        """GPUs of class `cls` on the node, free or not."""
        found = self._counts.get(cls)
        if found is None:
            found = self._counts[cls] = sum(1 for g in self.gpus if gpu_class(g) == cls)
        return found

    def chosen(self, cls: str, n: int) -> list[GPUInfo]:
        """The `n` free GPUs of class `cls` a rank would get (see `choose_gpus`)."""
        found = self._chosen.get((cls, n))
        if found is None:
            found = self._chosen[(cls, n)] = choose_gpus(self.free_gpus(cls), n)
        return found


def stale_marked(install: str, node: str, stale: bool) -> str:
    """A node's install progress as a refusal quotes it, marked while its installer is silent
    (`stale`): the node's surfaces said so, while the deployment's summary, `explain`, the page
    and the gateway's 503 quoted a killed installer's `downloading … (20%)` as live. The same
    words every step (no age in them): a refusal is published when its words change."""
    return f"{install}, stale: installer on {node} silent" if install and stale else install


def unusable_view(view: NodeView, exc: Exception) -> NodeView:
    """The view of a node whose status placement cannot use: no GPUs, engines or weights of its
    own, only why (logged with the traceback once, when the view is made)."""
    log.exception("node %s: its status cannot be used for placement", view.node)
    return NodeView(
        node=view.node,
        alive=view.alive,
        lost_for_s=view.lost_for_s,
        lost_since=view.lost_since,
        unusable=f"node status cannot be used: {fault_words(exc)}",
    )


def gpus_needed(profile: Profile) -> int:
    return profile.per_node_gpus if profile.gpu_class else 0


def unfit(
    node: NodeView,
    profile: Profile,
    deployment: Deployment,
    memo: dict[tuple[tuple[str, str, int], ...], list[Reason]] | None = None,
) -> Reason | None:
    """Why `node` cannot take one rank of `profile`, in the node's own words where it gave them.

    `memo` keeps the profile's validation per kind of GPU set across the nodes of one
    decision: a fleet has few kinds of GPU, and validating each node's anew is most
    of the cost of a multi-node decision.

    Of the deployment only its pool is read: a NodeIndex keeps one fabric table per
    profile and pool for every deployment of them (reading more would need more in its key).

    Never raises: a model's shape the estimate cannot use refuses the node in the estimate's
    words (`model hf://evil/bomb@main: the model's shape cannot be used: weight_bytes 10**400
    is outside …`), and any other fault in judging it refuses this node, logged with its
    traceback (the result is kept per view and deployment: logged once, not every step)."""
    try:
        return _unfit(node, profile, deployment, memo)
    except fit.FitError as exc:
        return Reason(f"model {profile.weights_key or profile.model_path}: {exc}", failures.MODEL_FIT)
    except Exception as exc:
        log.exception("cannot judge node %s for profile %s", node.node, profile.name)
        return Reason(
            f"placement cannot judge this node for profile {profile.name}: {fault_words(exc)}", failures.FAULT
        )


def _unfit(
    node: NodeView,
    profile: Profile,
    deployment: Deployment,
    memo: dict[tuple[tuple[str, str, int], ...], list[Reason]] | None,
) -> Reason | None:
    if node.unusable:
        return Reason(node.unusable, failures.UNUSABLE)
    if not node.alive:
        if node.lost_since:
            return Reason(f"lost: no heartbeat since {node.lost_since}", failures.LOST)
        return Reason(f"lost {int(node.lost_for_s)} s ago", failures.LOST)
    if node.claimed:
        return Reason(node.claimed, failures.CLAIMED)
    if node.cordoned:
        return Reason(node.cordoned, failures.CORDONED)
    if deployment.pool and deployment.pool not in node.pools:
        return Reason(f"not in pool {deployment.pool}", failures.POOL)
    if node.missing_models and profile.node_file in node.missing_models:
        return Reason(f"model file not found: {profile.node_file}", failures.MODEL_MISSING)
    engine = node.engines.get(profile.engine)
    if engine is None:
        if not node.install:
            return Reason(f"engine {profile.engine} not installed", failures.ENGINE_MISSING)
        installing = _INSTALLING.match(node.install) is not None
        return Reason(node.install, failures.ENGINE_INSTALLING if installing else failures.ENGINE_DOWN)
    if not engine.runs:
        # The node's own words: the install's progress while it installs, else the detail
        # the installer gave (why it failed, the library a broken build misses).
        # (`installing vllm 0.32.0 (cpu): importing vllm` is said once, not after its own name.)
        progress = node.install.removeprefix("installing: ").removeprefix(f"installing {profile.engine} ")
        words = engine.detail or (progress if engine.state == "installing" else "")
        said = f"engine {profile.engine} {engine.state}"
        readying = failures.ENGINE_INSTALLING if engine.state == "installing" else failures.ENGINE_DOWN
        return Reason(f"{said}: {words}" if words else said, readying)
    need = gpus_needed(profile)
    if profile.gpu_class and engine.cpu_only:
        # The node installed the CPU build (its driver runs none of the CUDA builds): a GPU
        # profile there would run on the CPU, several times slower, with nothing looking wrong.
        return Reason(f"engine {profile.engine} is the CPU build here: {engine.cpu_only}", failures.CPU_BUILD)
    if profile.gpu_class:
        if not node.gpus:
            return Reason(f"no GPUs, profile needs {profile.gpu_class}", failures.GPUS)
        if profile.gpu_class not in node.classes:
            classes = ", ".join(sorted(node.classes))
            return Reason(f"GPU class {classes}, profile needs {profile.gpu_class}", failures.GPUS)
        free = node.free_gpus(profile.gpu_class)
        if len(free) < need:
            have = f"{len(free)} of {node.count_of(profile.gpu_class)} GPUs free"
            return Reason(f"{have}, profile needs {need}", failures.GPUS)
        chosen = node.chosen(profile.gpu_class, need)
        kind = tuple((g.name, g.compute_capability, g.memory_mb) for g in chosen)
        problems = memo.get(kind) if memo is not None else None
        if problems is None:
            problems = _gpu_problems(profile, chosen, node.shapes.get(profile.weights_key))
            if memo is not None:
                memo[kind] = problems
        if problems:
            return problems[0]
    elif not node.avx2 and profile.engine != "sim":
        # Refused, not only warned: a CPU replica there looks as healthy as any other
        # and answers several times slower (docs/placement.md, "No AVX2").
        name = ENGINE_NAMES.get(profile.engine, profile.engine)
        return Reason(
            f"no AVX2: {name}'s CPU build would run several times slower here; "
            "place CPU profiles on nodes with AVX2 (`llmgw ctl nodes` marks those without), "
            "or give the profile a gpu_class",
            failures.AVX2,
        )
    else:
        shape = node.shapes.get(profile.weights_key)
        if shape is not None:
            too_big = fit.check_shard(shape, profile, memory_mb=node.memory_mb)
            if too_big:
                return Reason(too_big, failures.MODEL_FIT)
    if profile.nodes > 1 and not node.fabric:
        return Reason(f"on no fabric; profile needs {profile.nodes} nodes on one fabric", failures.FABRIC)
    return None


def _gpu_problems(profile: Profile, chosen: list[GPUInfo], shape: ModelShape | None) -> list[Reason]:
    """Why `profile` cannot run on the GPUs `chosen`: the engine's own checks (their words: the
    refusal is of this profile already), then whether the model's share fits the smallest of
    them (they are of one class) with its KV cache."""
    problems = [Reason(p.words, failures.PROFILE) for p in profile_problems(profile, chosen)]
    if not problems and shape is not None:
        too_small = fit.check_shard(shape, profile, chosen)
        if too_small:
            problems.append(Reason(too_small, failures.MODEL_FIT))
    return problems


def choose_gpus(free: Sequence[GPUInfo], n: int) -> list[GPUInfo]:
    """The first run of `n` consecutive indices if there is one, else the lowest `n`.

    Contiguous GPUs usually share a PCIe switch or NVLink domain; scattering a
    tensor-parallel group over the machine costs bandwidth.
    """
    if n <= 0:
        return []
    ordered = sorted(free, key=lambda g: g.index)
    for start in range(len(ordered) - n + 1):
        window = ordered[start : start + n]
        if window[-1].index - window[0].index == n - 1:
            return window
    return ordered[:n]


def weights_rank(node: NodeView, key: str) -> int:
    """0: the node holds the weights; 1: it is staging them; 2: neither (the origin, or a peer)."""
    return 0 if key in node.weights else 1 if key in node.coming else 2


def score(node: NodeView, profile: Profile, deployment: Deployment) -> tuple[object, ...]:
    free_after = len(node.free_gpus(profile.gpu_class)) - gpus_needed(profile) if profile.gpu_class else 0
    if deployment.strategy == "spread":
        # Only weights the node holds count here: counting those it is staging would stack a
        # new deployment's replicas on the node its first one went to.
        return (
            profile.weights_key not in node.weights,
            node.replicas_of.get(deployment.name, 0),
            -free_after,
            node.shards,
            node.node,
        )
    # binpack: the tightest fit first, keeping whole nodes free for big models.
    return (weights_rank(node, profile.weights_key), free_after, -node.shards, node.node)


def cached_score(node: NodeView, profile: Profile, deployment: Deployment, fp: str) -> tuple[object, ...]:
    # The strategy is part of the key: keyed without it, a view kept across a deployment's
    # switch from binpack to spread went on ranking by the binpack score it cached first.
    key = (fp, deployment.name, deployment.strategy)
    found = node._scores.get(key)
    if found is None:
        found = node._scores[key] = score(node, profile, deployment)
    return found
