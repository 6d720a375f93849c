"""Reading a service's `/metrics` as Prometheus does: parsed, never matched as text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample named `name` whose labels include `labels`; fails naming what there is."""
    found = [s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items()]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} samples {name}{labels} in /metrics:\n{text}")
    return found[0]


def families(text: str) -> dict[str, str]:
    """Every metric family exposed, by name, with its type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}
