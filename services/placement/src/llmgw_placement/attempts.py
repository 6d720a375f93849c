"""`Attempts`: one kind of attempt of the placement service, run again until it succeeds.

A failure costs that attempt; the delay before the next grows to a cap
(`llmgw_core.retry`); an outage is logged when it starts and when it ends, not at
every try. A lost lease is no failure of the attempt: it ends leading, and propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from llmgw_core.bus import LeaseLost
from llmgw_core.errors import BusError
from llmgw_core.retry import Retry

log = logging.getLogger("llmgw.placement")

# The pause after a failed attempt (a control step, a read), growing to the cap.
BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0


class Attempts(Retry):
    """Runs one kind of attempt again and again: a failure costs that attempt, the delay
    before the next grows to a cap (llmgw_core.retry), and an outage is logged when it
    starts and ends, not at every try. A lost lease is no failure of the attempt: it
    ends leading, and propagates."""

    def __init__(self, who: str, what: str, known: tuple[type[BaseException], ...] = (BusError,)) -> None:
        super().__init__(log, f"{who}: {what}", base_s=BACKOFF_FIRST_S, cap_s=BACKOFF_CAP_S, known=known)

    async def run(self, call: Callable[[], Awaitable[None]]) -> bool:
        return await self.attempt(call, fatal=(LeaseLost,))
