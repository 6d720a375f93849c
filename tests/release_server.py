"""A GitHub-shaped release API on loopback, whose downloads can misbehave on purpose."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llmgw_core.web import json_response


@dataclass
class ReleaseServer:
    repo: str = "ggml-org/llama.cpp"
    tag: str = "b9999"
    files: dict[str, bytes] = field(default_factory=dict)
    # name -> "ok" | "corrupt" | "truncate" | "404" | "500" | "500-once" | "stall" | "slow"
    behaviour: dict[str, str] = field(default_factory=dict)
    digests: bool = True
    checksum_file: bool = False
    requests: list[str] = field(default_factory=list)
    port: int = 0
    release_status: int = 200
    # The release lookup itself: "ok" | "500" | "500-once" | "stall" | "garbage"
    release_behaviour: str = "ok"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, name: str, data: bytes, behaviour: str = "ok") -> None:
        self.files[name] = data
        self.behaviour[name] = behaviour

    def add_file(self, path: Path, behaviour: str = "ok") -> None:
        self.add(path.name, path.read_bytes(), behaviour)

    def _assets(self) -> list[dict[str, object]]:
        assets: list[dict[str, object]] = []
        for name, data in sorted(self.files.items()):
            asset: dict[str, object] = {
                "name": name,
                "size": len(data),
                "browser_download_url": f"{self.api}/download/{self.tag}/{name}",
            }
            if self.digests:
                asset["digest"] = "sha256:" + hashlib.sha256(data).hexdigest()
            assets.append(asset)
        if self.checksum_file:
            sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(self.files.items()))
            self.files["SHA256SUMS"] = sums.encode()
            self.behaviour["SHA256SUMS"] = "ok"
            assets.append(
                {
                    "name": "SHA256SUMS",
                    "size": len(sums),
                    "browser_download_url": f"{self.api}/download/{self.tag}/SHA256SUMS",
                }
            )
        return assets

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle)])

    async def handle(self, req: Request) -> Response:
        path = req.url.path
        self.requests.append(path)
        if path == f"/repos/{self.repo}/releases/tags/{self.tag}":
            mode = self.release_behaviour
            if mode == "500-once":
                self.release_behaviour = "ok"
            if mode in ("500", "500-once"):
                return json_response({"message": "Server Error"}, 500)
            if mode == "stall":
                await anyio.sleep(3600)
            if mode == "garbage":
                return Response(b"<html>rate limited</html>", media_type="text/html")
            if self.release_status != 200:
                return json_response({"message": "Not Found"}, self.release_status)
            return Response(
                json.dumps({"tag_name": self.tag, "assets": self._assets()}).encode(),
                media_type="application/json",
            )
        prefix = f"/download/{self.tag}/"
        if not path.startswith(prefix):
            return json_response({"message": "Not Found"}, 404)
        name = path.removeprefix(prefix)
        data = self.files.get(name)
        mode = self.behaviour.get(name, "ok")
        if data is None or mode == "404":
            return json_response({"message": "Not Found"}, 404)
        if mode == "500":
            return json_response({"message": "boom"}, 500)
        if mode == "500-once":
            self.behaviour[name] = "ok"
            return json_response({"message": "boom"}, 500)
        if mode == "corrupt":
            return Response(data[:-1] + bytes([data[-1] ^ 0xFF]), media_type="application/octet-stream")
        if mode in ("truncate", "stall", "slow"):
            return StreamingResponse(self._partial(data, mode), media_type="application/octet-stream")
        return Response(data, media_type="application/octet-stream")

    async def _partial(self, data: bytes, mode: str) -> AsyncIterator[bytes]:
        half = len(data) // 2
        yield data[:half]
        if mode == "truncate":
            raise ConnectionError("cut off on purpose")
        if mode == "stall":
            await anyio.sleep(3600)
        # slow: the rest in small pieces, long enough to be killed mid-download
        for i in range(half, len(data), max(1, len(data) // 100)):
            await anyio.sleep(0.2)
            yield data[i : i + max(1, len(data) // 100)]
