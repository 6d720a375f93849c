"""`llmgw-gateway --config gateway.yaml`: one OpenAI-compatible endpoint for the cluster.

SIGTERM or Ctrl-C stops it, giving requests in flight a short grace.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import anyio

from llmgw_core import telemetry
from llmgw_core.config import load
from llmgw_core.errors import LlmgwError
from llmgw_core.lifecycle import cancel_on_signal, connect_service, while_connected

from .config import GatewayConfig
from .connections import raise_open_file_limit
from .service import Gateway


async def _main(config: GatewayConfig) -> None:
    # The gateway only reads: it creates no stream or bucket (its identity may not).
    bus = await connect_service(config.nats, "gateway", ensure=False)
    async with bus, while_connected(bus):
        gateway = Gateway(config, bus)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            port = await tg.start(gateway.run)
            print(f"llmgw-gateway: OpenAI endpoint on http://{config.http.host}:{port}/v1", flush=True)


def loop_options(use_uvloop: bool = True) -> dict[str, object]:
    """anyio's asyncio backend options: on uvloop where it is installed (a dependency wherever
    it has wheels). uvloop's loop, in C, costs less per callback and system call than asyncio's
    own: at 1 request in flight the gateway's per-request work is mostly such calls."""
    if use_uvloop and importlib.util.find_spec("uvloop") is not None:
        return {"use_uvloop": True}
    return {}


def run(config_path: str, *, use_uvloop: bool = True) -> int:
    """Run the gateway of `config_path` until stopped; `use_uvloop` false runs it on asyncio's
    own loop (the benchmark compares the two)."""
    try:
        config = load(config_path, GatewayConfig)
        telemetry.setup("llmgw-gateway")
        raise_open_file_limit()
        anyio.run(_main, config, backend_options=loop_options(use_uvloop))
    except LlmgwError as exc:
        print(f"llmgw-gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="gateway.yaml")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sys.exit(run(args.config))


if __name__ == "__main__":
    main()
