"""The simulator's LoRA adapters, loaded and unloaded at run time as vLLM's are (started with
VLLM_ALLOW_RUNTIME_LORA_UPDATING): `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`, at most `--max-loras` at once.

The path is read as vLLM reads it, a PEFT directory (`llmgw_core.adapter_peft`), its rank at most
`--max-lora-rank`. A request whose `model` names a loaded adapter is answered with words that
depend on the adapter's name: a test can tell which adapter answered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..adapter_peft import PeftError, read_peft
from ..web import json_response
from ._body import json_object

# How long a lora_name or lora_path the simulator takes (vLLM takes any; a model name is short).
_NAME_MAX = 256
_PATH_MAX = 4096


def _error(message: str, code: int = 400, kind: str = "BadRequestError") -> Response:
    # As vLLM's ErrorResponse.
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, code)


class Loras:
    """The adapters loaded now, by name, with the path each was loaded from."""

    def __init__(self, max_loras: int, max_rank: int, load_time: float) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.load_time = load_time
        self.loaded: dict[str, str] = {}
        self.loads = 0
        self.unloads = 0

    def salted(self, body: dict[str, Any], prompt: str) -> str:
        """What the answer's words are drawn from: the prompt, and the adapter `model` names
        where one is loaded (vLLM answers a loaded adapter's name with the adapter applied)."""
        model = body.get("model")
        if isinstance(model, str) and model in self.loaded:
            return f"lora:{model}\n{prompt}"
        return prompt

    async def _body(self, req: Request, *fields: str) -> dict[str, str] | Response:
        if self.max_loras <= 0:
            return _error("LoRA is not enabled: start the engine with --max-loras", 400)
        body = await json_object(req)
        if isinstance(body, str):
            return _error(body)
        out = {}
        for field in fields:
            value = body.get(field)
            limit = _PATH_MAX if field == "lora_path" else _NAME_MAX
            if not isinstance(value, str) or not 0 < len(value) <= limit:
                return _error(f"{field}: a string of 1 to {limit} characters is required")
            out[field] = value
        return out

    async def load(self, req: Request) -> Response:
        body = await self._body(req, "lora_name", "lora_path")
        if isinstance(body, Response):
            return body
        name, path = body["lora_name"], body["lora_path"]
        if name in self.loaded:
            return _error(f"The lora adapter '{name}' has already been loaded.")
        if len(self.loaded) >= self.max_loras:
            return _error(
                f"Cannot load LoRA adapter '{name}': {len(self.loaded)} of max_loras {self.max_loras} "
                "are loaded; unload one first"
            )
        try:
            await anyio.to_thread.run_sync(read_peft, Path(path), self.max_rank)
        except PeftError as exc:
            return _error(f"Loading lora {name} failed: {exc}")
        if self.load_time > 0:
            await anyio.sleep(self.load_time)
        if len(self.loaded) >= self.max_loras:  # another load took the slot meanwhile
            return _error(f"Cannot load LoRA adapter '{name}': max_loras {self.max_loras} are loaded")
        self.loaded[name] = path
        self.loads += 1
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, req: Request) -> Response:
        body = await self._body(req, "lora_name")
        if isinstance(body, Response):
            return body
        name = body["lora_name"]
        if self.loaded.pop(name, None) is None:
            return _error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        self.unloads += 1
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def models(self, parent: str) -> list[dict[str, Any]]:
        """The loaded adapters as vLLM's /v1/models lists them."""
        return [
            {"id": name, "object": "model", "owned_by": "llmgw-sim", "root": path, "parent": parent}
            for name, path in sorted(self.loaded.items())
        ]
