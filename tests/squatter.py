"""A process that holds a port and answers like an engine: /health 200, anything else
`{"who": "foreign"}`. Each request's path is appended to the file given, one a line, so a
test can count what reached it. `python squat.py PORT LOG` (copied where the test wants it)."""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        with open(sys.argv[2], "a") as log:
            log.write(self.path + "\n")
        body = b'{"status": "ok"}' if self.path == "/health" else b'{"who": "foreign"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        return


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("squatting", flush=True)
    server.serve_forever()
