"""Bad messages: counted, logged with subject and msgspec's path, and copied to the
service's DLQ (`<prefix>.dlq.<service>`); the consumer goes on."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TypeVar

import msgspec
import nats.errors

from ..events import decoder
from .connection import Connection
from .space import Space

log = logging.getLogger("llmgw.bus")

T = TypeVar("T", bound=msgspec.Struct)

# msgspec's error names the path and quotes the bad value (an enum's string, whole): a
# message that costs a log line or a DLQ header its own size is cut to this.
MAX_ERROR_CHARS = 512


def decode_error(exc: msgspec.DecodeError | msgspec.ValidationError) -> str:
    """msgspec's words for a value that does not decode, at most `MAX_ERROR_CHARS` long."""
    text = str(exc)
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[: MAX_ERROR_CHARS - 40]}… ({len(text):,} characters in all)"


class DecodeFailure(Exception):
    def __init__(self, subject: str, error: str) -> None:
        super().__init__(f"{subject}: {error}")
        self.subject = subject
        self.error = error


def decode(kind: type[T], subject: str, data: bytes) -> T:
    """`data` as a `kind`, or `DecodeFailure` with msgspec's words, bounded; nothing else
    escapes, whatever the bytes."""
    try:
        return decoder(kind).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeFailure(subject, decode_error(exc)) from exc


class DeadLetters:
    """The DLQ of one service, and how many bad messages it had per subject."""

    def __init__(self, conn: Connection, space: Space) -> None:
        self.conn = conn
        self.space = space
        self.decode_errors: Counter[str] = Counter()

    async def dead_letter(self, subject: str, data: bytes, error: str) -> None:
        """Count a message that could not be handled and copy it to the service's DLQ."""
        self.decode_errors[subject] += 1
        log.error(
            "%s: bad message on %s: %s (copied to %s)",
            self.conn.service,
            subject,
            error,
            self.conn.names.dlq(self.conn.service),
        )
        headers = {"Llmgw-Subject": subject, "Llmgw-Error": error[:1024]}
        try:
            await self.conn.js.publish(self.conn.names.dlq(self.conn.service), data, headers=headers)
        except nats.errors.Error as exc:
            full = await self.space.refusal(
                self.conn.names.dlq_stream, "copying a bad message to the DLQ", exc
            )
            log.error("%s: could not copy the bad message to the DLQ: %s", self.conn.service, full or exc)
        else:
            self.space.note_write(self.conn.names.dlq_stream)

    def decode(self, kind: type[T], subject: str, data: bytes) -> T:
        return decode(kind, subject, data)
