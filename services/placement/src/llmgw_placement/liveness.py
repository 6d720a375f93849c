"""Whether a node is alive, in its grace, or its launcher's reports stale: judged on what this
placement could hear.

One judge for every use: the leader's failover, `llmgw ctl nodes`, the API, the page
and the metrics, on a leader and on a standby alike (every placement keeps the
heartbeats in its `ClusterState`).
"""

from __future__ import annotations

from .config import ServerConfig
from .state import ClusterState


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
        and while it cannot hear the bus at all nobody is declared lost.
        A launcher that restarts (an upgrade) is silent for seconds while its
        engines serve on and its installer beats: failing the node over then
        would cost every replica on it for nothing.
        """
        seen = self.state.last_seen.get(node)
        silent = at - seen if seen is not None else float("inf")
        heard_from = self.state.heard_from
        if heard_from is None:
            return True, silent
        judged = min(silent, at - heard_from)
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
        judged = min(at - seen if seen is not None else float("inf"), at - heard_from)
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
        never = float("-inf")
        return frozenset(
            n
            for n in nodes
            if (silent := at - seen.get(n, never)) < timeout
            or (min(silent, since) < grace and at - installer.get(n, never) < timeout)
        )

    def launcher_stale(self, node: str, at: float) -> bool:
        """Whether the node's launcher has missed a few heartbeats: what it reported may be stale."""
        if self.state.heard_from is None:
            return False
        seen = max(self.state.last_seen.get(node, float("-inf")), self.state.heard_from)
        return at - seen > max(3 * self.config.heartbeat_interval_s, self.config.node_timeout_s / 2)
