"""`llmgw-installer --config agent.yaml`: probe this node, check its engines, report them.

`--once` converges once, prints the node's status and exits non-zero if any
engine is not running (for operators' scripts).
"""

from __future__ import annotations

import argparse
import sys

import anyio
import msgspec

from llmgw_core import telemetry
from llmgw_core.access import prepare_node
from llmgw_core.bus import Bus
from llmgw_core.config import AgentConfig, load
from llmgw_core.errors import LlmgwError
from llmgw_core.lifecycle import cancel_on_signal

from .service import Installer


async def _main(config: AgentConfig, once: bool) -> int:
    bus = await Bus.connect(config.nats, service=f"installer-{config.node}")
    async with bus:
        await prepare_node(bus)
        installer = Installer(config, bus)
        if once:
            await installer.load_desired()
            status = await installer.converge_once()
            sys.stdout.write(msgspec.json.format(msgspec.json.encode(status)).decode() + "\n")
            return 0 if all(e.runs for e in status.engines) else 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            await tg.start(installer.run)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-installer", description=__doc__)
    parser.add_argument("--config", required=True, help="agent.yaml")
    parser.add_argument("--once", action="store_true", help="converge once, print, exit")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load(args.config, AgentConfig)
        telemetry.setup(f"llmgw-installer/{config.node}")
        sys.exit(anyio.run(_main, config, args.once))
    except LlmgwError as exc:
        print(f"llmgw-installer: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
