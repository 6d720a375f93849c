"""llmgw's launcher: runs the shards placed on this node as supervised command sequences."""

from .reconcile import Diff, diff
from .service import Launcher

__all__ = ["Diff", "Launcher", "diff"]
