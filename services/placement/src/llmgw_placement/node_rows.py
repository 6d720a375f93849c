"""`/api/nodes`' rows: each node as its agents reported it, and whether placement hears it.

`NodeRows.nodes_json` writes the list from each node's row encoded once and kept until the
node reports anew; per request only what placement judges now is written into it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from llmgw_core.engines import GPUInfo
from llmgw_core.events import EngineState, NodeStatus

if TYPE_CHECKING:
    from .service import PlacementService


class NodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One node in `/api/nodes`: as its agents reported it, and whether placement hears it."""

    node: str
    alive: bool
    # Seconds since its launcher was last heard; -1 if never since this placement started.
    seen_s_ago: float
    # `n1 is claimed by two machines: …` while two machines send its heartbeats, else "".
    claimed: str = ""
    gpus: tuple[GPUInfo, ...]
    engines: tuple[EngineState, ...]
    install: str
    warnings: tuple[str, ...]
    probed_at: float
    # `cordoned by ops at …: why`, `draining (1 replica left) by …`, `drained by …`, else "".
    intent: str = ""
    # The model files its launcher reports missing (profiles reading them go elsewhere).
    missing_models: tuple[str, ...] = ()
    # What placement says is wrong with the node, each in one line (`installer on node-b silent
    # for 53 s: install progress stale`, `clock 600 s ahead of placement's`); `install` is then
    # marked stale too (`…, stale: no word for 53 s`).
    problems: tuple[str, ...] = ()


class _Reported(msgspec.Struct, frozen=True, kw_only=True):
    """A `NodeRow` after `seen_s_ago`: what changes only when the node reports anew."""

    gpus: tuple[GPUInfo, ...]
    engines: tuple[EngineState, ...]
    install: str
    warnings: tuple[str, ...]
    probed_at: float


_encode = msgspec.json.Encoder().encode


class NodeRows:
    """The rows of `/api/nodes`, as structs (`nodes`) and as JSON (`nodes_json`)."""

    def __init__(self, service: PlacementService) -> None:
        self.service = service
        # Per node: the status its `/api/nodes` row was last encoded from, and the encoded
        # rest of the row (see `nodes_json`).
        self._reported: dict[str, tuple[NodeStatus, bytes, bytes]] = {}

    def nodes(self) -> list[NodeRow]:
        at = time.monotonic()
        return [self.node_row(name, at) for name in sorted(self.service.state.nodes)]

    def node_row(self, name: str, at: float) -> NodeRow:
        view = self.service.view
        status = self.service.state.nodes[name]
        alive, since = view.alive(status.node, at)
        judged = view.judged(status.node, at)
        return NodeRow(
            node=status.node,
            alive=alive,
            seen_s_ago=round(since, 1) if since != float("inf") else -1.0,
            claimed=self.service.state.claims.claimed(status.node, at) or "",
            gpus=status.facts.gpus,
            engines=status.engines,
            install=judged.install_shown(status.install),
            warnings=status.warnings,
            probed_at=status.probed_at,
            intent=view.intent(status.node),
            missing_models=tuple(sorted(self.service.state.missing_models.get(status.node, ()))),
            problems=judged.problems(),
        )

    def nodes_json(self) -> bytes:
        """`nodes()` as JSON, newline-ended: the text encoding it writes, made from each node's
        row encoded once and kept until the node reports anew (its GPUs and engines are nine
        tenths of the bytes); per request only `alive`, `seen_s_ago` and `claimed` are written into it.
        Building and encoding every row afresh took a tenth of a second a request at 10,000
        nodes, on the loop that also hears their heartbeats."""
        heard = self.service.view.alive
        claims = self.service.state.claims
        contested = set(claims.contested(time.monotonic()))
        nodes = self.service.state.nodes
        at = time.monotonic()
        cached = self._reported
        kept: dict[str, tuple[NodeStatus, bytes, bytes]] = {}
        ages: dict[float, bytes] = {}
        parts: list[bytes] = [b"["]
        liveness = self.service.view.liveness
        clock_off = self.service.state.clock_off
        for name in sorted(nodes):
            status = nodes[name]
            if name in clock_off or liveness.installer_stale(name, at):
                # A node placement says something is wrong with: its whole row, made afresh.
                parts += (_encode(self.node_row(name, at)), b",")
                continue
            row = cached.get(name)
            if row is None or row[0] is not status:
                rest = _Reported(
                    gpus=status.facts.gpus,
                    engines=status.engines,
                    install=status.install,
                    warnings=status.warnings,
                    probed_at=status.probed_at,
                )
                # `{"node":…,"alive":` and `,"gpus":…}`: NodeRow's fields in its order.
                row = (
                    status,
                    b'{"node":' + _encode(status.node) + b',"alive":',
                    b"," + _encode(rest)[1:-1],
                )
            claimed = (claims.claimed(name, at) or "") if name in contested else ""
            kept[name] = row
            alive, since = heard(status.node, at)
            seen = round(since, 1) if since != float("inf") else -1.0
            age = ages.get(seen)
            if age is None:
                age = ages[seen] = _encode(seen)
            parts += (
                row[1],
                b'true,"seen_s_ago":' if alive else b'false,"seen_s_ago":',
                age,
                b',"claimed":' + _encode(claimed) if claimed else b',"claimed":""',
                row[2],
                b',"intent":' + _encode(self.service.view.intent(name)),
                b',"missing_models":'
                + _encode(sorted(self.service.state.missing_models.get(name, ())))
                + b',"problems":[]}',
                b",",
            )
        self._reported = kept  # a node that left is dropped here
        if len(parts) > 1:
            parts.pop()  # the last row's comma
        parts.append(b"]\n")
        return b"".join(parts)
