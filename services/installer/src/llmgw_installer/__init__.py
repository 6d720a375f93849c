"""llmgw's installer: what can this node run, and if not, why not yet?"""

from .service import Installer, node_facts

__all__ = ["Installer", "node_facts"]
