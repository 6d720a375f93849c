"""`llmgw-launcher --config agent.yaml`: run the shards placed on this node.

SIGTERM or Ctrl-C stops the launcher and leaves the engines running; the next
launcher adopts them.
"""

from __future__ import annotations

import argparse
import signal
import sys

import anyio

from llmgw_core import telemetry
from llmgw_core.bus import prepare_node
from llmgw_core.config import AgentConfig, load
from llmgw_core.errors import LlmgwError
from llmgw_core.lifecycle import connect_service, while_connected

from .service import Launcher


async def _main(config: AgentConfig, stop_engines: bool) -> None:
    # A launcher may start before NATS (a rebooted node): it waits, saying so once.
    bus = await connect_service(config.nats, f"launcher-{config.node}", ensure=False)
    # A connection that NATS closed for good ends the launcher, engines left running:
    # the next launcher adopts them.
    async with bus, while_connected(bus):
        await prepare_node(bus)
        launcher = Launcher(config, bus)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                await tg.start(launcher.run)
            if stop_engines:
                # Still inside the receiver: a second signal cannot cut the
                # engines' stop short and leave them running.
                await launcher.stop_all()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-launcher", description=__doc__)
    parser.add_argument("--config", required=True, help="agent.yaml")
    parser.add_argument(
        "--stop-engines-on-exit",
        action="store_true",
        help="stop every engine when the launcher stops (for throwaway local clusters)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load(args.config, AgentConfig)
        telemetry.setup("llmgw-launcher", node=config.node)
        anyio.run(_main, config, args.stop_engines_on_exit)
    except LlmgwError as exc:
        print(f"llmgw-launcher: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C while it waits for NATS or for the streams
        sys.exit(130)


if __name__ == "__main__":
    main()
