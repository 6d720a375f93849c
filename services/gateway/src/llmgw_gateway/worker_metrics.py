"""`/metrics` of a gateway of several workers: every worker's series in one scrape.

The kernel hands each new connection to any worker, so a scrape of the shared port reaches
one of them; its counters alone would read as a counter reset at every scrape that lands
elsewhere. So each worker also serves its own registry on a private loopback port, written
in the supervisor's run directory (`<dir>/<K>`), and the worker a scrape reaches asks every
other for its registry, then answers all of them, each sample labelled `worker="K"` (sum by
the other labels for the gateway's total). A worker that does not answer within
PEER_TIMEOUT_S is left out of that scrape and counted in `llmgw_gateway_workers_unscraped`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("llmgw.gateway")

# How long a scrape waits for another worker's registry.
PEER_TIMEOUT_S = 2.0


def publish_port(run_dir: str, index: int, port: int) -> None:
    """Say in `run_dir` that worker `index` serves its registry on loopback `port` (written
    whole, then renamed: a reader never sees half a number)."""
    path = Path(run_dir) / str(index)
    part = path.with_suffix(".part")
    part.write_text(str(port))
    os.replace(part, path)


def peer_ports(run_dir: str, index: int) -> dict[str, int]:
    """The other workers' registry ports, by worker index (as text: the label's value)."""
    out: dict[str, int] = {}
    try:
        entries = list(Path(run_dir).iterdir())
    except OSError as exc:
        log.warning("cannot read the workers' run directory %s: %s", run_dir, exc)
        return out
    for entry in entries:
        if not entry.name.isdigit() or entry.name == str(index):
            continue
        try:
            out[entry.name] = int(entry.read_text())
        except (OSError, ValueError):
            continue  # being replaced by a restarted worker
    return out


def merged(texts: dict[str, str], unscraped: int = 0) -> bytes:
    """The registries' expositions (text format, by worker) as one, every sample labelled with
    its worker; `unscraped`: the workers that did not answer."""
    families: dict[str, Metric] = {}
    for worker in sorted(texts, key=int):
        for family in text_string_to_metric_families(texts[worker]):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(s._replace(labels={**s.labels, "worker": worker}) for s in family.samples)
    gap = GaugeMetricFamily(
        "llmgw_gateway_workers_unscraped",
        "Other workers of this gateway that did not give their metrics to this scrape (their "
        "series are missing from it).",
        value=unscraped,
    )

    class _Merged:
        def collect(self) -> Iterator[Metric]:
            yield from families.values()
            yield gap

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


async def gather(client: httpx.AsyncClient, own: tuple[str, str], ports: dict[str, int]) -> bytes:
    """`own` (this worker's index and exposition) with every peer's, fetched at once."""
    texts = {own[0]: own[1]}
    missing = 0

    async def fetch(worker: str, port: int) -> None:
        nonlocal missing
        try:
            r = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=PEER_TIMEOUT_S)
            r.raise_for_status()
            texts[worker] = r.text
        except httpx.HTTPError as exc:
            missing += 1
            log.warning("worker %s's metrics (port %d) are not in this scrape: %s", worker, port, exc)

    async with anyio.create_task_group() as tg:
        for worker, port in ports.items():
            tg.start_soon(fetch, worker, port)
    return merged(texts, missing)
