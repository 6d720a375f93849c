"""The gateway's HTTP surface as data: the routed paths, what each is to OpenTelemetry, the
headers that never pass through, and the scope key that carries a request the express lane
hands over. Imported by every module of the request's path; imports none of them."""

from __future__ import annotations

# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself.
HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        # Anthropic's clients send the key here: the gateway's secret, never the replica's.
        "x-api-key",
    }
)
# Also dropped from a replica's answer: the gateway's HTTP server sets its own `Date`, and the
# gateway says which replica served it (`x-llmgw-replica`), never the replica.
HOP_OUT = HOP | {"date", "x-llmgw-replica"}
# As the ASGI server and the replica connections carry them.
HOP_BYTES = frozenset(h.encode() for h in HOP)
HOP_OUT_BYTES = frozenset(h.encode() for h in HOP_OUT)
# The proxied paths (POST, routed by the body's `model`).
ROUTED = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
)
ROUTED_PATHS = frozenset(ROUTED)
NONE: frozenset[str] = frozenset()
# The deployment label of a request refused before its deployment was known.
UNKNOWN = "(unknown)"
# Each routed path's `gen_ai.operation.name` (OpenTelemetry's GenAI semantic conventions).
OPERATION = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
# The paths whose streamed answers end with a usage chunk when asked (`stream_options`).
USAGE_OPTION = frozenset({"/v1/chat/completions", "/v1/completions"})
# Where a request the express lane handed over carries its `Routed` (an ASGI scope key).
RESUMED = "llmgw.resumed"
# Statuses whose answers carry no body: given no length, and left to the ASGI path.
NO_BODY = frozenset({204, 304})


def first(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    """The first value of header `name` (lower case, as the server read it), or ""."""
    for n, v in headers:
        if n == name:
            return v.decode("latin-1")
    return ""
