"""llmgw_core's exceptions.

    LlmgwError                 base; `retryable` says whether trying again can help
    ├── ConfigError            a config file or value is wrong (not retryable)
    ├── BusError               NATS or JetStream failed (retryable)
    │   ├── ConnectionLost     NATS closed this client's connection for good: no call on it
    │   │                      can succeed again; a new connection (a restart) is needed
    │   └── SubjectTooLong     (llmgw_core.access) refused before sending: the server would
    │                          have closed the connection
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


class EngineValidationError(LlmgwError):
    retryable = False

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
