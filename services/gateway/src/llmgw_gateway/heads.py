"""A request's head, bounded as it arrives: llhttp (httptools) keeps every byte of a header
until its line ends, and uvicorn every header of a request, with no limit of their own. A
header over `field_bytes`, more than `fields` headers, or a head over `section_bytes` is
refused (`HeaderTooLarge`: the protocol answers 431 and closes the connection)."""

from __future__ import annotations

from dataclasses import dataclass

from .limits import shown

# What a head not yet complete may hold past `section_bytes` before it is refused: the
# request line's method and version, and each header line's `: ` and CRLF, which the exact
# count (`HeadCount.bytes`) adds as 4 a header.
HEAD_SLACK = 1024


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """How large a request's head may be (gateway.yaml's `http:`): one header (its name and
    value), the number of headers, and the whole head (the request target and every header
    line); and the bytes of heads the gateway holds at once, every connection's together."""

    field_bytes: int = 16 << 10
    section_bytes: int = 64 << 10
    fields: int = 100
    in_flight_bytes: int = 64 << 20


class HeaderTooLarge(Exception):
    """A request's head past a limit of `HeaderLimits`: answered 431, the connection closed."""


class HeadCount:
    """The size of one request's head so far, checked at each piece the parser hands over:
    its target (`target`), each header (`field`), and the bytes of a head not yet complete
    (`unfinished`: the parser keeps a header's bytes until its line ends, so a 1 MiB header
    is refused once its first 65 KiB are in, not once it is whole). Raises `HeaderTooLarge`,
    and nothing else, past a limit."""

    __slots__ = ("bytes", "fields", "limits")

    def __init__(self, limits: HeaderLimits) -> None:
        self.limits = limits
        self.bytes = 0
        self.fields = 0

    def reset(self) -> None:
        self.bytes = 0
        self.fields = 0

    def target(self, size: int) -> None:
        self.bytes += size
        if self.bytes > self.limits.section_bytes:
            raise HeaderTooLarge(self._section_message(self.bytes, "by its target and headers"))

    def field(self, name: bytes, value: bytes) -> None:
        # On every header of every request: the checks inline, the words only for a refusal.
        size = len(name) + len(value)
        self.fields += 1
        self.bytes += size + 4
        limits = self.limits
        if size > limits.field_bytes or self.fields > limits.fields or self.bytes > limits.section_bytes:
            raise self._refusal(name, size)

    def unfinished(self, received: int) -> None:
        """`received` bytes of a head not yet complete are in."""
        if received > self.limits.section_bytes + HEAD_SLACK:
            raise HeaderTooLarge(self._section_message(received, "and not yet complete"))

    def _refusal(self, name: bytes, size: int) -> HeaderTooLarge:
        limits = self.limits
        if self.fields > limits.fields:
            return HeaderTooLarge(
                f"the request has more than {limits.fields} headers (the gateway's http: "
                "max_header_fields); send fewer"
            )
        if size > limits.field_bytes:
            return HeaderTooLarge(
                f"request header {shown(name.decode('latin-1'))} is {size} bytes, over the gateway's "
                f"limit of {limits.field_bytes} a header (http: max_header_field_bytes); send it smaller"
            )
        return HeaderTooLarge(self._section_message(self.bytes, "by its target and headers"))

    def _section_message(self, size: int, how: str) -> str:
        return (
            f"the request's head is {size} bytes {how}, over the gateway's limit of "
            f"{self.limits.section_bytes} (http: max_header_section_bytes); send fewer or smaller headers"
        )
