"""llmgw's shared core: engine adapters, events, the bus client, validation and the node probe.

Services import from here and from nowhere else in llmgw.
"""

from .errors import BusError, ConfigError, EngineValidationError, LlmgwError

__all__ = ["BusError", "ConfigError", "EngineValidationError", "LlmgwError"]
