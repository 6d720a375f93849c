"""An OTLP/HTTP trace receiver standing in for Jaeger in tests/test_containers.py.

POST /v1/traces on :4318 takes what llmgw's exporters send (protobuf, gzip or
not) and keeps the spans in memory. On :16686 it answers the two calls of
Jaeger's query API that an operator's first look uses, in Jaeger's shape:
GET /api/services and GET /api/traces?service=<name>.
"""

from __future__ import annotations

import gzip
import json
import signal
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OTLP_PORT = 4318
QUERY_PORT = 16686

_lock = threading.Lock()
# service name -> trace id (hex) -> span names in arrival order
_traces: dict[str, dict[str, list[dict[str, str]]]] = defaultdict(lambda: defaultdict(list))


def record(body: bytes) -> int:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    count = 0
    with _lock:
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "unknown_service",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    _traces[service][span.trace_id.hex()].append(
                        {"spanID": span.span_id.hex(), "operationName": span.name}
                    )
                    count += 1
    return count


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        self._reply(status, json.dumps(value).encode(), "application/json")

    def do_POST(self) -> None:
        if self.server.server_address[1] != OTLP_PORT or self.path != "/v1/traces":
            self._json(404, {"error": f"no route POST {self.path}"})
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            count = record(body)
        except Exception as exc:  # a malformed export is the sender's problem, not a crash here
            self._json(400, {"error": f"not an OTLP ExportTraceServiceRequest: {exc}"})
            return
        print(f"otlp-receiver: {count} spans", flush=True)
        self._reply(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if self.server.server_address[1] != QUERY_PORT:
            self._json(404, {"error": f"no route GET {url.path}"})
        elif url.path == "/api/services":
            with _lock:
                services = sorted(_traces)
            self._json(200, {"data": services, "total": len(services)})
        elif url.path == "/api/traces":
            service = parse_qs(url.query).get("service", [""])[0]
            with _lock:
                traces = [
                    {
                        "traceID": trace_id,
                        "spans": [dict(s, traceID=trace_id, processID="p1") for s in spans],
                        "processes": {"p1": {"serviceName": service}},
                    }
                    for trace_id, spans in _traces.get(service, {}).items()
                ]
            self._json(200, {"data": traces, "total": len(traces)})
        else:
            self._json(404, {"error": f"no route GET {url.path}"})

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    servers = [ThreadingHTTPServer(("0.0.0.0", port), _Handler) for port in (OTLP_PORT, QUERY_PORT)]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    # PID 1 in its container: without a handler SIGTERM is ignored and `down` waits to kill.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"otlp-receiver: OTLP/HTTP on :{OTLP_PORT}, query API on :{QUERY_PORT}", flush=True)
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
