"""`llmgw up`: a cluster on this machine, stopped cleanly by Ctrl-C."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio

from llmgw_core import telemetry
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.natsd import NatsServer


async def _serve(data_dir: Path, port: int) -> int:
    server = NatsServer(store_dir=data_dir / "nats", port=port, log_path=data_dir / "nats.log")
    await anyio.to_thread.run_sync(server.start)
    try:
        bus = await Bus.connect(BusOptions(url=server.url), service="llmgw-up")
        async with bus:
            await bus.ensure()
        print(f"llmgw: NATS JetStream ready at {server.url} (data in {data_dir})", flush=True)
        print("llmgw: streams and buckets created; press Ctrl-C to stop", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        print("llmgw: stopping", flush=True)
    finally:
        await anyio.to_thread.run_sync(server.stop)
    return 0


def run(data_dir: str, port: int) -> int:
    telemetry.setup("llmgw-up")
    try:
        return anyio.run(_serve, Path(data_dir).resolve(), port)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(run(".llmgw", 4222))
