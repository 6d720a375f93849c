"""`llmgw ctl`'s errors: each one line on stderr and an exit code a script can test.

CtlError       base (exit 1)
├── UsageError   2: the command line is wrong (a bad name, negative replicas)
├── NotFound     3: what was named does not exist
├── Refused      4: the cluster refuses it (an unknown profile, a permission, an identity)
├── Unreachable  5: NATS, or the launcher asked, did not answer in time
├── Conflict     5: another writer changed what `apply` compared, nothing written (run it again)
└── CannotStore  6: NATS refused the write for space, or placement cannot act on it for that
"""

from __future__ import annotations

from llmgw_core.errors import LlmgwError


class CtlError(LlmgwError):
    exit_code = 1


class UsageError(CtlError):
    exit_code = 2


class NotFound(CtlError):
    """What was named does not exist (exit code 3)."""

    exit_code = 3


class Refused(CtlError):
    exit_code = 4


class Unreachable(CtlError):
    exit_code = 5


class Conflict(CtlError):
    """Another writer changed what `apply` had compared the file with, and nothing of that was
    written: exit code 5, as for NATS not answering, since running it again is what helps."""

    exit_code = 5


class CannotStore(CtlError):
    """NATS refused the write for space (nothing was changed), or stored it while placement
    cannot write (nothing acts on it until NATS stores again): exit code 6."""

    exit_code = 6
