"""`ServerFiles`: what each placement's server.yaml would seed, said and heard.

Placements that seed different files seed whichever the first to lead read: each
says its own (`PlacementFile`, a digest and what it names) every FILE_EVERY_S, and
one whose file differs from another's is told as a warning, until that one is
silent for FILE_FORGOTTEN_S (it left).
"""

from __future__ import annotations

import logging
import time

import anyio
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import now

from .attempts import Attempts
from .desired import PlacementFile, file_difference

log = logging.getLogger("llmgw.placement")

# How often each placement says what its server.yaml would seed, and after how long
# without a word another placement's file is forgotten (it left).
FILE_EVERY_S = 10.0
FILE_FORGOTTEN_S = 3.5 * FILE_EVERY_S


class ServerFiles:
    """This placement's file, and the others' as each last said it."""

    def __init__(self, bus: Bus, identity: str, file: PlacementFile) -> None:
        self.bus = bus
        self.identity = identity
        # What this placement's server.yaml would seed, and other placements' files, as each
        # last said (and when, time.monotonic()).
        self.file = file
        self.files: dict[str, tuple[PlacementFile, float]] = {}
        self._file_asked = anyio.Event()

    def differences(self) -> list[str]:
        """How each other placement's file, heard lately, differs from this one's."""
        at = time.monotonic()
        out = []
        for name in sorted(self.files):
            theirs, heard = self.files[name]
            difference = file_difference(self.file, theirs) if at - heard < FILE_FORGOTTEN_S else None
            if difference:
                out.append(difference)
        return out

    async def run(self) -> None:
        """Say what this placement's server.yaml would seed, now and every FILE_EVERY_S (at
        once when another placement is first heard), and hear what the others say."""
        names = self.bus.names

        async def heard(theirs: PlacementFile, _subject: str) -> None:
            if theirs.placement == self.identity:
                return
            before = self.files.get(theirs.placement)
            self.files[theirs.placement] = (theirs, time.monotonic())
            if before is None:
                self._file_asked.set()  # so that it hears this one's without waiting
            if before is None or before[0].digest != theirs.digest:
                difference = file_difference(self.file, theirs)
                if difference:
                    log.warning("%s: %s", self.identity, difference)

        hearing = Attempts(self.identity, "hearing other placements' files")
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    await tg.start(self.bus.subscribe_core, names.placement_file, PlacementFile, heard)
                    break
                except BusError as exc:
                    await anyio.sleep(hearing.failed(exc))
            hearing.succeeded()
            while True:
                self._file_asked = anyio.Event()
                try:
                    await self.bus.publish_core(
                        names.placement_file, msgspec.structs.replace(self.file, at=now())
                    )
                except BusError as exc:
                    log.debug("%s: could not say what its server.yaml seeds: %s", self.identity, exc)
                with anyio.move_on_after(FILE_EVERY_S):
                    await self._file_asked.wait()
                for name, (_, at) in list(self.files.items()):
                    if time.monotonic() - at > FILE_FORGOTTEN_S:
                        del self.files[name]
