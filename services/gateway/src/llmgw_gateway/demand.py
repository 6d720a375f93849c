"""What this gateway reports of its demand: per deployment, requests in flight, held and
arrived, and in flight per replica (`events.Demand`, on `<prefix>.demand.<gateway id>`).

Pure but for its counters: the proxy counts arrivals; `report` reads the routing table's
in-flight counts and the held queues, and returns the report. A deployment is in a report
while it has anything to say, and in one more with zeros once it has nothing left, so that
the last word a reader has of it is not a stale count; then it is left out.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections import Counter
from collections.abc import Mapping

import anyio

from llmgw_core.events import Demand, DeploymentDemand, ReplicaInFlight


def default_id() -> str:
    """This process's gateway id where the config names none: the host's name, the process id
    and a random tail (two gateways in one process, or a pid reused, still differ)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64].strip("-") or "gateway"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class DemandCounts:
    def __init__(self) -> None:
        # Requests routed to each deployment since the last report.
        self.arrived: Counter[str] = Counter()
        # Deployments the last report had a non-zero count for.
        self._said: set[str] = set()
        # Set to ask for a report now (a deployment's first held request); replaced after each.
        self.wanted = anyio.Event()

    def arrive(self, deployment: str) -> None:
        self.arrived[deployment] += 1

    def report(
        self,
        gateway: str,
        outstanding: Mapping[str, int],
        queued: Mapping[str, int],
        *,
        interval_s: float,
        at: float,
    ) -> Demand:
        """The report to send now, from the in-flight count per replica key
        (`<deployment>.<replica>`) and the held count per deployment; resets the arrivals."""
        replicas: dict[str, list[ReplicaInFlight]] = {}
        for key, n in sorted(outstanding.items()):
            if n > 0:
                deployment, _, replica = key.partition(".")
                replicas.setdefault(deployment, []).append(ReplicaInFlight(replica=replica, in_flight=n))
        now = {name for name, n in queued.items() if n > 0} | set(replicas) | set(+self.arrived)
        rows = []
        for name in sorted(now | self._said):
            per = replicas.get(name, [])
            rows.append(
                DeploymentDemand(
                    deployment=name,
                    in_flight=sum(r.in_flight for r in per),
                    queued=queued.get(name, 0),
                    arrived=self.arrived.get(name, 0),
                    replicas=tuple(per),
                )
            )
        self._said = now
        self.arrived.clear()
        return Demand(gateway=gateway, deployments=tuple(rows), interval_s=interval_s, at=at)
