"""llmgw's placement: what runs where, and why not elsewhere?"""

from .config import ServerConfig
from .decide import NodeView, Placement, Refusal, decide
from .service import PlacementService

__all__ = ["NodeView", "Placement", "PlacementService", "Refusal", "ServerConfig", "decide"]
