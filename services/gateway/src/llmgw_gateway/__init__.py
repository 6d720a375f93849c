"""llmgw's gateway: one stable OpenAI-compatible endpoint in front of every deployment's ready replicas."""

from .config import GatewayConfig, HttpConfig
from .proxy import Proxy
from .routing import Table
from .service import Gateway

__all__ = ["Gateway", "GatewayConfig", "HttpConfig", "Proxy", "Table"]
