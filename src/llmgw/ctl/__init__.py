"""`llmgw ctl`: read the cluster through the bus, print it for people or scripts, and change
what the operator owns (deployments, the catalog). Fields and exit codes: docs/ctl.md."""

from ._args import add_parser
from ._commands import apply, delete_deployment, deploy, explain, nodes, run
from ._errors import CannotStore, CtlError, NotFound, Refused, Unreachable, UsageError
from ._read import liveness
from ._views import table

__all__ = [
    "CannotStore",
    "CtlError",
    "NotFound",
    "Refused",
    "Unreachable",
    "UsageError",
    "add_parser",
    "apply",
    "delete_deployment",
    "deploy",
    "explain",
    "liveness",
    "nodes",
    "run",
    "table",
]
