"""The cluster page's event feed: one line for each event on the bus, in the words its writer
gave, or None for the ones the page skips (an install's progress within a step); bytes that
are no event are dead-lettered by the page's listener.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw_core import failures
from llmgw_core.bus import DecodeFailure
from llmgw_core.bus.deadletter import decode_error

from .view import reasons_text

# The most characters of one event's line: a reason quotes what a node or an engine said.
EVENT_CHARS = 600


def event_body(subject: str, data: bytes) -> dict[str, Any]:
    """An event's JSON object, or `DecodeFailure` with msgspec's words (bounded)."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeFailure(subject, decode_error(exc)) from exc
    if not isinstance(body, dict):
        raise DecodeFailure(subject, f"an event is a JSON object, not a {type(body).__name__}")
    return body


def event_line(subject: str, data: bytes, steps: dict[tuple[str, str], str] | None = None) -> str | None:
    """One line for an event, in the words its writer gave; None for the ones the page skips
    (and for bytes that are no event: `event_body` says what they are)."""
    try:
        body = event_body(subject, data)
    except DecodeFailure:
        return None
    return body_line(body, steps)


def body_line(body: dict[str, Any], steps: dict[tuple[str, str], str] | None = None) -> str | None:
    """`event_line` of a decoded event.

    `steps`: each install's step so far, by (node, engine). Given it, progress within a step
    (`downloading … (38%, …)`, every second or so) is skipped: it updates the node's row, and
    the event list keeps what matters, a new step and how the install ended."""
    line = _event_words(body, steps)
    if line is None or len(line) <= EVENT_CHARS:
        return line
    return line[:EVENT_CHARS] + "…"


def reason_said(state: object, reason: object) -> str:
    """`: why` after a state, without the state said twice: placement's reason for a replica it
    drains reads `draining: scaled down`, and `draining: draining: scaled down` was shown."""
    if not reason:
        return ""
    why = failures.one_line(str(reason)).removeprefix(f"{state}: ")
    return f": {why}" if why else ""


def _event_words(body: dict[str, Any], steps: dict[tuple[str, str], str] | None) -> str | None:
    kind = body.get("kind")
    if kind == "ReplicaStatus":
        state = body.get("state")
        said = reason_said(state, body.get("reason"))
        return f"replica {body.get('deployment')}/{body.get('replica')} {state}{said}"
    if kind == "ShardStatus":
        state = body.get("state")
        return f"shard {body.get('node')}/{body.get('shard')} {state}{reason_said(state, body.get('reason'))}"
    if kind == "PlacementDecision":
        if body.get("outcome") == "placed":
            nodes = body.get("nodes")
            on = ", ".join(str(n) for n in nodes) if isinstance(nodes, list) else ""
            return f"placed {body.get('deployment')}/{body.get('replica')} on {on}"
        given = body.get("reasons")
        pairs = [
            (str(r.get("node")), str(r.get("reason")))
            for r in (given if isinstance(given, list) else ())
            if isinstance(r, dict)
        ]
        return f"cannot place {body.get('deployment')}: {reasons_text(pairs)}"
    if kind == "DeploymentStatus":
        return str(body.get("summary", ""))
    if kind == "ScaleDecision":
        return f"{body.get('deployment')}: {body.get('reason')}"
    if kind == "InstallProgress":
        if steps is not None:
            install = (str(body.get("node")), str(body.get("engine")))
            if body.get("outcome", "running") != "running":
                steps.pop(install, None)
            elif steps.get(install) == body.get("step"):
                return None
            else:
                steps[install] = str(body.get("step"))
        return f"{body.get('node')}: {body.get('message')}"
    if kind == "NodeLifecycle":
        return f"node {body.get('node')} {body.get('state')}"
    return None
