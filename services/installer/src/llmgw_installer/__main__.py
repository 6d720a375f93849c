"""`llmgw-installer --config agent.yaml`: probe this node, check its engines, report them.

`--once` converges once, prints the node's status and exits with:
  0  every engine runs (installed or configured)
  1  an engine was refused or is not running; the status printed says why
  2  configuration error (agent.yaml unreadable or wrong)
  3  internal error: the installer itself failed (a fault, or the bus unreachable)
"""

from __future__ import annotations

import argparse
import logging
import sys

import anyio
import msgspec

from llmgw_core import telemetry
from llmgw_core.bus import Bus, prepare_node
from llmgw_core.config import AgentConfig, load
from llmgw_core.errors import ConfigError, LlmgwError
from llmgw_core.lifecycle import cancel_on_signal, connect_service, while_connected

from .service import Installer

INSTALLED, REFUSED, CONFIG_ERROR, INTERNAL_ERROR = 0, 1, 2, 3

log = logging.getLogger("llmgw.installer")


async def _main(config: AgentConfig, once: bool) -> int:
    service = f"installer-{config.node}"
    # As a service it waits for NATS (it may start first); `--once` reports an unreachable bus.
    bus = (
        await Bus.connect(config.nats, service=service)
        if once
        else await connect_service(config.nats, service, ensure=False)
    )
    async with bus, while_connected(bus):
        # As a service it waits for placement's streams as long as it takes; `--once` reports them missing.
        await prepare_node(bus, timeout=30 if once else None)
        installer = Installer(config, bus)
        if once:
            await installer.load_desired()
            status = await installer.converge_once()
            if status is not None:
                sys.stdout.write(msgspec.json.format(msgspec.json.encode(status)).decode() + "\n")
            if installer.faulted or status is None:
                print(f"llmgw-installer: {installer.install_words or 'internal error'}", file=sys.stderr)
                return INTERNAL_ERROR
            return INSTALLED if all(e.runs for e in status.engines) else REFUSED
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            await tg.start(installer.run)
    return INSTALLED


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="llmgw-installer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="agent.yaml")
    parser.add_argument("--once", action="store_true", help="converge once, print, exit (codes below)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load(args.config, AgentConfig)
    except ConfigError as exc:
        print(f"llmgw-installer: {exc}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    telemetry.setup("llmgw-installer", node=config.node)
    try:
        code = anyio.run(_main, config, args.once)
    except ConfigError as exc:
        print(f"llmgw-installer: {exc}", file=sys.stderr)
        code = CONFIG_ERROR
    except LlmgwError as exc:
        print(f"llmgw-installer: {exc}", file=sys.stderr)
        code = INTERNAL_ERROR
    except KeyboardInterrupt:  # Ctrl-C while it waits for NATS or for the streams
        code = 130
    except Exception as exc:
        log.error("internal error: %s", exc, exc_info=exc)
        print(f"llmgw-installer: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = INTERNAL_ERROR
    sys.exit(code)


if __name__ == "__main__":
    main()
