"""The simulator's LoRA adapters, loaded and unloaded at run time as vLLM's are (started with
VLLM_ALLOW_RUNTIME_LORA_UPDATING): `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`.

As vLLM 0.32's `load_lora_adapter` (`entrypoints/openai/models/serving.py`), a load is not
refused for the number loaded: vLLM's registry takes any number, `--max-loras` bounds the
adapters of one batch (and its CPU cache evicts by LRU); keeping to it is the launcher's work.

The path is read as vLLM reads it, a PEFT directory (`llmgw_core.adapter_peft`), its rank at most
`--max-lora-rank`. A request whose `model` names a loaded adapter is answered with words that
depend on the adapter's name: a test can tell which adapter answered. The adapters with
requests running (`running`, streamed answers being generated) are what the engine's LoRA
gauge names, as vLLM's `vllm:lora_requests_info` does.
"""

from __future__ import annotations

from collections import Counter
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
        # Requests being generated now, by the adapter they asked for.
        self.running: Counter[str] = Counter()

    def adapter(self, body: dict[str, Any]) -> str:
        """The loaded adapter a request's `model` names, or "" (the base)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.loaded else ""

    def salted(self, body: dict[str, Any], prompt: str) -> str:
        """What the answer's words are drawn from: the prompt, and the adapter `model` names
        where one is loaded (vLLM answers a loaded adapter's name with the adapter applied)."""
        adapter = self.adapter(body)
        return f"lora:{adapter}\n{prompt}" if adapter else prompt

    def began(self, adapter: str) -> None:
        """A request for `adapter` ("": the base) is being generated."""
        if adapter:
            self.running[adapter] += 1

    def ended(self, adapter: str) -> None:
        """A request `began` ended, whole or not."""
        if adapter:
            self.running[adapter] -= 1
            if self.running[adapter] <= 0:
                del self.running[adapter]

    def requests_info(self) -> dict[str, str]:
        """The labels of the LoRA gauge now, as vLLM's: the adapters with requests running and
        waiting (the simulator queues none), comma-separated."""
        running = ",".join(sorted(self.running))
        return {
            "max_lora": str(self.max_loras),
            "running_lora_adapters": running,
            "waiting_lora_adapters": "",
        }

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
        try:
            await anyio.to_thread.run_sync(read_peft, Path(path), self.max_rank)
        except PeftError as exc:
            return _error(f"Loading lora {name} failed: {exc}")
        if self.load_time > 0:
            await anyio.sleep(self.load_time)
        if name in self.loaded:  # loaded by another request meanwhile
            return _error(f"The lora adapter '{name}' has already been loaded.")
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
