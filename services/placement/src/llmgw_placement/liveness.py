"""Whether a node is alive, in its grace, or its launcher's reports stale: judged on what this
placement could hear.

One judge for every use: the leader's failover, `llmgw ctl nodes`, the API, the page
and the metrics, on a leader and on a standby alike (every placement keeps the
heartbeats in its `ClusterState`).
"""

from __future__ import annotations

from llmgw_core.events import CLOCK_OFFSET_END_S, CLOCK_OFFSET_S, NodeLiveness

from .config import ServerConfig
from .state import ClusterState


def clock_off(offset: float, was_off: bool) -> bool:
    """Whether a node's clock offset (its clock minus placement's) is a warning: over
    `CLOCK_OFFSET_S` either way, and, once it is, until it is back under `CLOCK_OFFSET_END_S`
    (a clock near the line would otherwise start and end a warning with every beat)."""
    return abs(offset) > (CLOCK_OFFSET_END_S if was_off else CLOCK_OFFSET_S)


def clock_turn(
    offset: float, was_off: bool, crossed_at: float | None, at: float, settle_s: float
) -> tuple[bool, float | None]:
    """Whether the node's clock warning holds after a beat measured `offset` at `at`, and since
    when the beats have said otherwise (None: they agree with `was_off`). The warning starts or
    ends only once the beats have said so for `settle_s`: beats queued while placement was
    behind arrive late, read as a clock behind by the delay, and a warning for every node of
    the fleet after one stall would be noise."""
    if clock_off(offset, was_off) == was_off:
        return was_off, None
    since = at if crossed_at is None else crossed_at
    if at - since >= settle_s:
        return not was_off, None
    return was_off, since


class Liveness:
    """Reads `state` (never writes it) with the timeouts of `config`."""

    def __init__(self, config: ServerConfig, state: ClusterState) -> None:
        self.config = config
        self.state = state

    def alive(self, node: str, at: float) -> tuple[bool, float]:
        """Whether the node's launcher was heard within `node_timeout` (or, while its installer
        still is, within `launcher_grace_s`), and for how long it was not.

        Silence counts only from when this placement could hear it: after its
        own start, reconnect or stall every node gets a full timeout again,
        and while it cannot hear the bus at all nobody is declared lost. A node
        that just joined gets a full timeout from when its status was first read:
        its first heartbeat may come after it (500 nodes joining at once were
        each `lost: no heartbeat since this placement started` for a moment).
        A launcher that restarts (an upgrade) is silent for seconds while its
        engines serve on and its installer beats: failing the node over then
        would cost every replica on it for nothing.
        """
        seen = self.state.last_seen.get(node)
        silent = at - seen if seen is not None else float("inf")
        heard_from = self.state.heard_from
        if heard_from is None:
            return True, silent
        judged = min(silent, at - max(heard_from, self.state.first_known.get(node, heard_from)))
        if judged < self.config.node_timeout_s:
            return True, silent
        return judged < self.config.launcher_grace_s and self.installer_heard(node, at), silent

    def installer_heard(self, node: str, at: float) -> bool:
        installer = self.state.installer_seen.get(node)
        return installer is not None and at - installer < self.config.node_timeout_s

    def in_grace(self, node: str, at: float) -> float | None:
        """Seconds of `launcher_grace_s` left while the node is alive only by its installer, else None."""
        seen = self.state.last_seen.get(node)
        heard_from = self.state.heard_from
        if heard_from is None:
            return None
        since = at - max(heard_from, self.state.first_known.get(node, heard_from))
        judged = min(at - seen if seen is not None else float("inf"), since)
        if judged < self.config.node_timeout_s or not self.installer_heard(node, at):
            return None
        left = self.config.launcher_grace_s - judged
        return left if left > 0 else None

    def alive_nodes(self, at: float) -> frozenset[str]:
        """The nodes `alive` says are alive at `at`, in one pass over the nodes."""
        nodes = self.state.nodes
        timeout = self.config.node_timeout_s
        grace = self.config.launcher_grace_s
        heard_from = self.state.heard_from
        if heard_from is None or at - heard_from < timeout:
            return frozenset(nodes)
        since = at - heard_from
        seen = self.state.last_seen
        installer = self.state.installer_seen
        known = self.state.first_known
        never = float("-inf")
        return frozenset(
            n
            for n in nodes
            if (silent := min(at - seen.get(n, never), at - known.get(n, never))) < timeout
            or (min(silent, since) < grace and at - installer.get(n, never) < timeout)
        )

    def launcher_stale(self, node: str, at: float) -> bool:
        """Whether the node's launcher has missed a few heartbeats: what it reported may be stale."""
        if self.state.heard_from is None:
            return False
        seen = max(self.state.last_seen.get(node, float("-inf")), self.state.heard_from)
        return at - seen > self._stale_after()

    def installer_beats(self, node: str, at: float) -> bool:
        """Whether the node's installer is heard by the clock its launcher's silence is judged
        on (`launcher_stale`): a few heartbeats, counted from when this placement could hear.
        An agent restart is told from a dead machine by it; judged on `node_timeout_s` instead,
        an installer killed with its launcher read as still beating (`an agent restart?`) for
        seconds after the launcher read as silent."""
        heard_from = self.state.heard_from
        if heard_from is None:
            return self.installer_heard(node, at)
        seen = self.state.installer_seen.get(node)
        return seen is not None and at - max(seen, heard_from) <= self._stale_after()

    def installer_stale(self, node: str, at: float) -> bool:
        """Whether the node's launcher beats while its installer has missed a few heartbeats: the
        install progress its status shows is the installer's last word (a killed installer's
        `downloading … (92%)` would otherwise read as live for good). Only for a node whose
        launcher runs apart from an installer, and judged on what this placement could hear."""
        heard_from = self.state.heard_from
        if heard_from is None or node not in self.state.with_installer or self.launcher_stale(node, at):
            return False
        seen = max(self.state.installer_seen.get(node, float("-inf")), heard_from)
        return at - seen > self._stale_after()

    def _stale_after(self) -> float:
        return max(3 * self.config.heartbeat_interval_s, self.config.node_timeout_s / 2)

    def judged(self, node: str, at: float) -> NodeLiveness:
        """The node as every surface shows it: alive or lost and for how long, its installer's
        silence, a claim by two machines, an agent restart's grace, its clock's offset."""
        state = self.state
        alive, silent = self.alive(node, at)
        installer = state.installer_seen.get(node)
        grace = self.in_grace(node, at)
        return NodeLiveness(
            node=node,
            alive=alive,
            silent_s=round(silent, 1) if silent != float("inf") else -1.0,
            installer_silent_s=round(at - installer, 1) if installer is not None else -1.0,
            claimed=state.claims.claimed(node, at) or "",
            grace_left_s=round(grace, 1) if grace is not None else -1.0,
            installer_stale=self.installer_stale(node, at),
            clock_offset_s=round(state.clock_offset.get(node, 0.0), 1) if node in state.clock_off else 0.0,
            missing_models=tuple(sorted(state.missing_models.get(node, ()))),
        )
