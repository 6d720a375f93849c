"""A shard's failure, formatted where it is shown: ctl, the cluster page and the API all
take their words from here, and the launcher its text for readers that predate the fields.

A failure travels as fields (`ShardFailure`: reason, exit, log tail, attempt). Its text
form, "<reason>; last log lines:\\n<lines>", is written only for old readers; the one place
that reads it back is `failure_of`, for a launcher or placement that predates the fields.

A node's refusal of a replica travels so too (`NodeReason`: node, words, kind): readers act
on its kind (`readying`); the one place that reads its words instead is `readying`, for a
placement that predates kinds.
"""

from __future__ import annotations

import re
import signal

from .events import NodeReason, ReplicaRecord, ShardFailure, ShardStatus

__all__ = [
    "REFUSAL_KINDS",
    "details",
    "failure_of",
    "how_it_ended",
    "one_line",
    "readying",
    "reason_line",
    "retrying",
    "summary",
    "text",
]

# Between a failure's reason and the log lines it quotes, in its text form.
_LOG_MARK = "; last log lines:"


def summary(failure: ShardFailure | None) -> str:
    """The failure in one line, without its log lines; "" for none."""
    return failure.reason.split("\n", 1)[0] if failure is not None else ""


def text(failure: ShardFailure | None) -> str:
    """The failure whole: its reason, then the failing attempt's last log lines; "" for none."""
    if failure is None:
        return ""
    if not failure.log_tail:
        return failure.reason
    return f"{failure.reason}{_LOG_MARK}\n" + "\n".join(failure.log_tail)


def details(failure: ShardFailure) -> str:
    """The failure's attempt and exit status in words ("attempt 3, exit code 42", "attempt 2,
    killed by SIGKILL"); "" where neither is known."""
    words = [f"attempt {failure.attempt}"] if failure.attempt else []
    if failure.exit is not None and failure.exit >= 0:
        words.append(f"exit code {failure.exit}")
    elif failure.exit is not None:
        try:
            words.append(f"killed by {signal.Signals(-failure.exit).name}")
        except ValueError:
            words.append(f"killed by signal {-failure.exit}")
    return ", ".join(words)


def retrying(attempt: int, failure: ShardFailure) -> str:
    """The reason of a shard or replica that starts again: which attempt, and why the last ended."""
    return f"attempt {attempt}; last: {summary(failure)}"


def one_line(reason: str) -> str:
    """A reason in one line. A failed status's reason quotes the log after its first line
    (as its text form does, for old readers); tables show the first line only."""
    return reason.split("\n", 1)[0].removesuffix(_LOG_MARK) if reason else ""


def reason_line(status: ShardStatus) -> str:
    """A shard's reason in one line: a failed shard's from its failure's fields."""
    if status.state == "failed" and status.failure is not None:
        return summary(status.failure)
    return one_line(status.reason)


def failure_of(value: ShardStatus | ReplicaRecord) -> ShardFailure | None:
    """The last failure of a shard or replica as fields; from a writer that predates them,
    read from its text (the attempt and exit status are then unknown: 0 and None)."""
    if value.failure is not None:
        return value.failure
    if not value.last_failure:
        return None
    reason, _, lines = value.last_failure.partition(f"{_LOG_MARK}\n")
    at = value.last_failure_at if isinstance(value, ShardStatus) else 0.0
    return ShardFailure(reason=reason, log_tail=tuple(lines.split("\n")) if lines else (), at=at)


def how_it_ended(code: int) -> str:
    """A child process's end from its return code (minus the signal that killed it), as the
    processes llmgw supervises are said to have ended: `exited with code 2`, `was killed by
    signal SIGKILL`."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# What refused a node (`NodeReason.kind`), as placement's feasibility names it.
UNUSABLE = "unusable"  # placement cannot use the node's status at all
LOST = "lost"  # no heartbeat within node_timeout_s
CLAIMED = "claimed"  # two machines send the node's heartbeats
CORDONED = "cordoned"  # the operator keeps new replicas off it (cordon, drain)
POOL = "pool"  # not in the deployment's pool
MODEL_MISSING = "model-missing"  # the node's launcher found the model file missing
ENGINE_INSTALLING = "engine-installing"  # the node's installer is at work on the engine
ENGINE_MISSING = "engine-missing"  # the engine is not installed, and the installer said nothing yet
ENGINE_DOWN = "engine-down"  # the engine's install failed, or its build is broken
CPU_BUILD = "cpu-build"  # a GPU profile, and the node installed the engine's CPU build
GPUS = "gpus"  # no GPUs, none of the profile's class, or too few free
PROFILE = "profile"  # the profile cannot run on the GPUs the node would give it
MODEL_FIT = "model-fit"  # the model does not fit the node's memory, or its shape is unusable
AVX2 = "avx2"  # a CPU profile on a node without AVX2
FABRIC = "fabric"  # a multi-node profile: no fabric, too few fitting nodes on it, no port in common
FAULT = "fault"  # placement could not judge the node (its log has the traceback)
CATALOG = "catalog"  # the deployment names no profile of the catalog
REFUSAL_KINDS = frozenset(
    {
        UNUSABLE,
        LOST,
        CLAIMED,
        CORDONED,
        POOL,
        MODEL_MISSING,
        ENGINE_INSTALLING,
        ENGINE_MISSING,
        ENGINE_DOWN,
        CPU_BUILD,
        GPUS,
        PROFILE,
        MODEL_FIT,
        AVX2,
        FABRIC,
        FAULT,
        CATALOG,
    }
)
# The node is getting ready for the profile: its installer may yet make the engine run there.
READYING_KINDS = frozenset({ENGINE_INSTALLING, ENGINE_MISSING})
# A placement that predates kinds said so only in words: the installer's progress (`installing:
# …`), the engine's state (`engine llamacpp installing: …`), or `engine vllm not installed`.
_READYING_WORDS = re.compile(r"(installing\b|engine \S+ (installing\b|not installed$))")


def readying(reason: NodeReason) -> bool:
    """Whether the refusing node is getting ready for the profile (its engine installing, or
    not installed yet), so that a replica may be placed there soon: read from the reason's
    kind, or, from a placement that predates kinds, its words."""
    if reason.kind:
        return reason.kind in READYING_KINDS
    return _READYING_WORDS.match(reason.reason) is not None
