"""`llmgw-placement --config server.yaml`: the cluster's control plane (one active, others stand by)."""

from __future__ import annotations

import argparse
import sys

import anyio

from llmgw_core import telemetry
from llmgw_core.config import load
from llmgw_core.errors import LlmgwError
from llmgw_core.lifecycle import cancel_on_signal, connect_service, while_connected
from llmgw_core.web import serve

from .api import Api
from .config import ServerConfig
from .page import Page
from .service import PlacementService


async def _main(config: ServerConfig) -> None:
    bus = await connect_service(config.nats, "placement")
    async with bus, while_connected(bus):
        service = PlacementService(config, bus)
        api = Api(service)
        page = Page(service, api.nodes, catalog=api.catalog, usage=api.usage)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            await tg.start(service.run)
            tg.start_soon(page.listen)
            tg.start_soon(api.usage.follow)
            port = await tg.start(serve, api.app(page.routes()), config.http.host, config.http.port)
            print(f"llmgw-placement: API on http://{config.http.host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-placement", description=__doc__)
    parser.add_argument("--config", required=True, help="server.yaml")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load(args.config, ServerConfig)
        telemetry.setup("llmgw-placement", node=config.identity)
        anyio.run(_main, config)
    except LlmgwError as exc:
        print(f"llmgw-placement: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
