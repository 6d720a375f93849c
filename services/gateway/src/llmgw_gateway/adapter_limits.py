"""Each LoRA adapter's own limits, as the gateways enforce them (docs/adapters.md).

An adapter may carry `rpm` and `tpm` (`llmgw_core.adapters.Adapter`): the requests and tokens
per minute of every key that calls it, together. An operator serving many teams' adapters on a
shared base caps each so that one team's adapter cannot take the base's capacity. The gateways
count an adapter's minute as they count a key's (`budgets.Budgets`, shared through the limits
bucket), under the window name `adapter.<name>`: a key's name holds no dot, so no key can
take it, and no key's count is an adapter's.

The limits are what placement says of each deployment (`DeploymentStatus.adapter_quotas`, its
profile's adapters that have limits): gateways may not read the catalog, whose profiles carry
engines' environments. Every value is outside bytes, bounded as the bus decodes it (at most
ADAPTERS_MAX adapters, names of the name rule, limits within LIMIT_MAX); a status that breaks a
bound is skipped (counted, dead-lettered), the other deployments' limits kept.

Pure: the service feeds `observe` every deployment status placement publishes.
"""

from __future__ import annotations

from typing import NamedTuple

from llmgw_core.adapters import AdapterQuota

# Before an adapter's name in its window's name in the limits bucket.
WINDOW_PREFIX = "adapter."


class AdapterLimit(NamedTuple):
    """An adapter's limits as `Budgets` counts them: `name` is its window's name."""

    name: str
    rpm: int
    tpm: int
    adapter: str


def window_name(adapter: str) -> str:
    """The name of `adapter`'s minute in the limits bucket."""
    return WINDOW_PREFIX + adapter


class AdapterLimits:
    """Deployment -> the limits its profile's adapters carry; and by adapter, its limit."""

    __slots__ = ("_by_adapter", "_profiles")

    def __init__(self) -> None:
        self._profiles: dict[str, dict[str, AdapterLimit]] = {}
        # Made again from `_profiles` at the first read after a change.
        self._by_adapter: dict[str, AdapterLimit] | None = None

    def observe(self, key: str, quotas: tuple[AdapterQuota, ...]) -> None:
        """What placement says of deployment `key`'s adapters' limits now (a deployment deleted
        says none)."""
        limited = {
            a.name: AdapterLimit(window_name(a.name), a.rpm, a.tpm, a.name) for a in quotas if a.rpm or a.tpm
        }
        if self._profiles.get(key, {}) == limited:
            return
        if limited:
            self._profiles[key] = limited
        else:
            self._profiles.pop(key, None)
        self._by_adapter = None

    def of(self, adapter: str) -> AdapterLimit | None:
        """`adapter`'s limits; None where it has none of its own. Where two deployments' profiles
        name one adapter (written around the checks), the first deployment by name says."""
        if self._by_adapter is None:
            found: dict[str, AdapterLimit] = {}
            for key in sorted(self._profiles, reverse=True):
                found.update(self._profiles[key])
            self._by_adapter = found
        return self._by_adapter.get(adapter)
