"""The cluster page's markup: its parts (`Frag`, `Keyed`), escaping and moments as the page
shows them, and what changed between two renders (`changes`), the server-sent event a
stream sends next.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def when(at: float) -> str:
    """A moment as the page shows it: its UTC time, which a script turns into `5 s ago` and
    keeps current in the browser. A text that the server rewrote every second would change
    every replica's row on every tick, and the stream would send them all again."""
    at = int(at)
    return (
        f"<time data-at={at} title='{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at))}'>"
        f"{time.strftime('%H:%M:%S', time.gmtime(at))} UTC</time>"
    )


class Frag(NamedTuple):
    """An element with an id (`html` is the whole element): sent again whole when it changes."""

    id: str
    html: str


class Keyed(NamedTuple):
    """A container (its markup from `open` to `close`, `open` carrying `id`) of elements with
    ids, in order: a change sends the new order and the elements that are new or changed."""

    id: str
    open: str
    items: list[Frag]
    close: str


Part = str | Frag | Keyed


def document_of(parts: list[Part]) -> str:
    out: list[str] = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Frag):
            out.append(p.html)
        else:
            out += (p.open, *(i.html for i in p.items), p.close)
    return "".join(out)


@dataclass
class Sent:
    """What one stream has sent: the parts' shape (static markup and ids, in order), each
    element's markup and each container's order."""

    shape: tuple[str, ...] = ()
    frags: dict[str, str] = field(default_factory=dict)
    orders: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _shape(parts: list[Part]) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else f"#{p.id}" for p in parts)


def changes(before: Sent | None, parts: list[Part]) -> tuple[Sent, bytes | None]:
    """The next server-sent event for a stream that has sent `before` (None: nothing yet), and
    what it will then have sent. A first render, or one whose shape changed (a section or a
    group of nodes came or went), is the whole view (`event: view`); otherwise a patch of the
    elements that changed and the containers whose order changed (`event: patch`), or None
    when nothing did."""
    sent = Sent(shape=_shape(parts))
    for p in parts:
        if isinstance(p, Frag):
            sent.frags[p.id] = p.html
        elif isinstance(p, Keyed):
            sent.orders[p.id] = tuple(i.id for i in p.items)
            for i in p.items:
                sent.frags[i.id] = i.html
    if before is None or before.shape != sent.shape:
        data = "".join(f"data: {line}\n" for line in document_of(parts).split("\n"))
        return sent, f"event: view\n{data}\n".encode()
    changed = {k: v for k, v in sent.frags.items() if before.frags.get(k) != v}
    orders = {k: list(v) for k, v in sent.orders.items() if before.orders.get(k) != v}
    if not changed and not orders:
        return sent, None
    body = msgspec.json.encode({"set": changed, "order": orders})
    return sent, b"event: patch\ndata: " + body + b"\n\n"
