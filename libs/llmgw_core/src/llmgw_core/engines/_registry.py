from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..events import ShardSpec
from ._types import Engine


class UnknownEngineError(KeyError):
    """An engine name that no adapter answers to."""

    def __str__(self) -> str:
        return str(self.args[0])


@runtime_checkable
class InstallableEngine(Protocol):
    def use_installed(self, path: str) -> bool: ...


@runtime_checkable
class ExtraPortsEngine(Protocol):
    def extra_ports(self, shard: ShardSpec) -> int:
        """How many ports of the node's range the shard's processes need beyond its HTTP port."""
        ...


def extra_ports_needed(engine: Engine, shard: ShardSpec) -> int:
    return engine.extra_ports(shard) if isinstance(engine, ExtraPortsEngine) else 0


class Registry:
    """Engine adapters by name."""

    def __init__(self) -> None:
        self._engines: dict[str, Engine] = {}

    def add(self, engine: Engine) -> None:
        """Add an adapter, replacing any with the same name."""
        self._engines[engine.name] = engine

    def get(self, name: str) -> Engine:
        try:
            return self._engines[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownEngineError(f"unknown engine {name!r}; known engines: {known}") from None

    def api_paths(self, name: str) -> frozenset[str] | None:
        """The HTTP API paths engine `name`'s server answers; None for an engine not known here."""
        engine = self._engines.get(name)
        if engine is None:
            return None
        return engine.api_paths

    def names(self) -> list[str]:
        return sorted(self._engines)

    def use_installed(self, name: str, path: str) -> bool:
        """Point `name` at the build in `path`; False if it takes no installed builds."""
        engine = self.get(name)
        if isinstance(engine, InstallableEngine):
            return engine.use_installed(path)
        return False


def default_registry() -> Registry:
    from .llamacpp import LlamaCpp
    from .sglang import SGLang
    from .sim import Sim
    from .vllm import VLLM

    registry = Registry()
    for engine in (VLLM(), SGLang(), LlamaCpp(), Sim()):
        registry.add(engine)
    return registry
