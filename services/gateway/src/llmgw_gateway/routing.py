"""Which replica serves a request: the routing table kept from the buckets, and its choices.

Pure: the service feeds it every change of the replicas and deployments
buckets; the proxy asks it which deployment a `model` names, which ready
replica to send to (least outstanding requests first), and, when there is
none, why, in the replicas' own words.

Where no replica is known ready, a replica whose readiness is `unknown` and
that still has a URL is sent to: its launcher went silent while its engines
were last heard ready (a launcher restarting, an agent upgrade), and placement
keeps that URL only while it judges the node alive. A request it cannot take
costs a connection attempt and goes to the next replica.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from llmgw_core import failures
from llmgw_core.events import Deployment, DeploymentStatus, ReplicaRecord


@dataclass
class Table:
    deployments: dict[str, Deployment] = field(default_factory=dict)
    # `<deployment>.<replica>` -> its record.
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    # Placement's last `DeploymentStatus` per deployment: its reason when none can be placed.
    statuses: dict[str, DeploymentStatus] = field(default_factory=dict)
    # Requests in flight per replica key.
    outstanding: Counter[str] = field(default_factory=Counter)
    # When each replica key was last chosen: among equally busy replicas, the one
    # chosen longest ago goes next, so one client's requests in turn reach them all.
    _last_pick: dict[str, int] = field(default_factory=dict)
    _picks: itertools.count[int] = field(default_factory=itertools.count)

    # --- the buckets' changes ----------------------------------------------------

    def set_deployment(self, name: str, value: Deployment | None) -> None:
        if value is None:
            self.deployments.pop(name, None)
        else:
            self.deployments[name] = value

    def set_status(self, status: DeploymentStatus) -> None:
        self.statuses[status.deployment] = status

    def set_replica(self, key: str, value: ReplicaRecord | None) -> None:
        if value is None:
            self.replicas.pop(key, None)
            self._last_pick.pop(key, None)
        else:
            self.replicas[key] = value

    # --- names -------------------------------------------------------------------

    def known(self) -> list[str]:
        """Every deployment the gateway knows, sorted: from the deployments bucket, and any
        deployment that still has replica records (one being deleted, or a bucket it cannot read)."""
        return sorted({*self.deployments, *(r.deployment for r in self.replicas.values())})

    def aliases(self, deployment: str) -> tuple[str, ...]:
        d = self.deployments.get(deployment)
        return d.aliases if d is not None else ()

    def resolve(self, model: str) -> str | None:
        """The deployment that `model` names: its name, else an alias (the first deployment
        by name wins where two claim the same alias)."""
        known = self.known()
        if model in known:
            return model
        for name in known:
            if model in self.aliases(name):
                return name
        return None

    def describe_known(self) -> str:
        parts = []
        for name in self.known():
            aliases = self.aliases(name)
            parts.append(f"{name} (aliases: {', '.join(aliases)})" if aliases else name)
        return ", ".join(parts) or "none (no deployment exists yet)"

    # --- choosing ----------------------------------------------------------------

    def of(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        return sorted((k, r) for k, r in self.replicas.items() if r.deployment == deployment)

    def ready(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        return [(k, r) for k, r in self.of(deployment) if r.state == "ready" and r.url]

    def unknown(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        """Replicas whose launcher is silent while their engines were last heard ready."""
        return [(k, r) for k, r in self.of(deployment) if r.state == "unknown" and r.url]

    def pick(
        self, deployment: str, exclude: frozenset[str] = frozenset()
    ) -> tuple[str, ReplicaRecord] | None:
        """The ready replica with the fewest requests in flight, not in `exclude`; where none
        is left, the `unknown` one with a URL that has the fewest."""
        candidates = [(k, r) for k, r in self.ready(deployment) if k not in exclude]
        if not candidates:
            candidates = [(k, r) for k, r in self.unknown(deployment) if k not in exclude]
        if not candidates:
            return None
        key, record = min(
            candidates, key=lambda kr: (self.outstanding[kr[0]], self._last_pick.get(kr[0], -1))
        )
        self._last_pick[key] = next(self._picks)
        return key, record

    def unavailable(self, deployment: str, now: float | None = None) -> str:
        """Why `deployment` has no ready replica, quoting each replica's state (and for how long,
        `now` being wall-clock time) and reason."""
        records = self.of(deployment)
        d = self.deployments.get(deployment)
        if not records:
            if d is not None and d.replicas == 0:
                return f"deployment {deployment} has 0 ready replicas: it is scaled to 0"
            status = self.statuses.get(deployment)
            if status is not None and status.unplaceable and status.summary:
                # Placement's own words, every node's reason included ("chat: 0 of 2 ready;
                # 2 cannot be placed: node-a no GPU of class H100, …").
                return f"deployment {deployment} has 0 ready replicas: {status.summary}"
            # Not refused (yet): placing it, or placement has not spoken of it.
            return (
                f"deployment {deployment} has 0 ready replicas: none placed yet "
                f"(`llmgw ctl explain {deployment}` shows placement's reason)"
            )
        parts = []
        for _, r in records:
            part = f"{r.replica} {r.state}"
            if now is not None and r.since:
                part += f" for {max(0, round(now - r.since))}s"
            why = failures.one_line(r.reason) or failures.summary(failures.failure_of(r))
            parts.append(f"{part} ({why})" if why else part)
        return f"deployment {deployment} has 0 ready replicas: {'; '.join(parts)}"
