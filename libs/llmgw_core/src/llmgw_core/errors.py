"""llmgw_core's exceptions.

    LlmgwError                 base; `retryable` says whether trying again can help
    ├── ConfigError            a config file or value is wrong (not retryable)
    ├── BusError               NATS or JetStream failed (retryable)
    │   ├── ConnectionLost     NATS closed this client's connection for good: no call on it
    │   │                      can succeed again; a new connection (a restart) is needed
    │   ├── SubjectTooLong     (llmgw_core.access) refused before sending: the server would
    │   │                      have closed the connection
    │   └── StoreFull          NATS refused a write for space: nothing of it was stored
    └── EngineValidationError  a profile cannot run here (not retryable until it changes)

Callers decide on `retryable`, never on the message text.
"""

from __future__ import annotations


class LlmgwError(Exception):
    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class ConfigError(LlmgwError):
    retryable = False


class BusError(LlmgwError):
    retryable = True


class ConnectionLost(BusError):
    retryable = False


class StoreFull(BusError):
    """NATS refused a write for space (its store, a bucket's limit, or the disk is full): the
    write was not stored. Retrying helps once space is freed, not at once (docs/operations.md)."""

    retryable = True

    def __init__(self, message: str, *, stream: str = "", banner: str = "") -> None:
        super().__init__(message)
        self.stream = stream
        # The episode as every surface says it: `NATS store full: …: writes refused since 18:24:09`.
        self.banner = banner


class EngineValidationError(LlmgwError):
    retryable = False

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
