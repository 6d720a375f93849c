"""`llmgw-gateway --config gateway.yaml`: one OpenAI-compatible endpoint for the cluster.

SIGTERM or Ctrl-C stops it, giving requests in flight a short grace. With `http: workers`
(or `--workers`) above 1, the process started is the workers' supervisor (`workers.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass

import anyio
import msgspec

from llmgw_core import telemetry
from llmgw_core.config import load
from llmgw_core.errors import LlmgwError
from llmgw_core.lifecycle import cancel_on_signal, connect_service, while_connected

from .config import GatewayConfig, worker_count
from .connections import raise_open_file_limit
from .demand import default_id
from .service import Gateway
from .workers import Supervisor, say_ready, watch_parent


async def _main(config: GatewayConfig, worker: WorkerOf | None = None) -> None:
    """Serve until a signal; `worker`: one of several, which shares its port and tells its
    supervisor on a pipe once it serves (the supervisor announces the endpoint)."""
    # Its supervisor, as it was when the worker started.
    parent = os.getppid()
    # The gateway only reads: it creates no stream or bucket (its identity may not).
    bus = await connect_service(config.nats, "gateway", ensure=False)
    async with bus, while_connected(bus):
        of = (worker.index, worker.run_dir) if worker is not None else None
        gateway = Gateway(config, bus, reuse_port=worker is not None, worker=of)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            if worker is not None:
                tg.start_soon(watch_parent, parent, tg.cancel_scope)
            port = await tg.start(gateway.run)
            if worker is not None:
                say_ready(worker.ready_fd)
            else:
                print(f"llmgw-gateway: OpenAI endpoint on http://{config.http.host}:{port}/v1", flush=True)


def loop_options(use_uvloop: bool = True) -> dict[str, object]:
    """anyio's asyncio backend options: on uvloop where it is installed (a dependency wherever
    it has wheels). uvloop's loop, in C, costs less per callback and system call than asyncio's
    own: at 1 request in flight the gateway's per-request work is mostly such calls."""
    if use_uvloop and importlib.util.find_spec("uvloop") is not None:
        return {"use_uvloop": True}
    return {}


@dataclass(frozen=True)
class WorkerOf:
    """What a supervisor tells worker `index` (`--worker`): the port all share (one of port 0
    picked once), its demand id, the pipe to say it serves on, and the directory where the
    workers find each other's metrics."""

    index: int
    port: int
    gateway_id: str
    ready_fd: int
    run_dir: str


def run(
    config_path: str, *, use_uvloop: bool = True, workers: int | None = None, worker: WorkerOf | None = None
) -> int:
    """Run the gateway of `config_path` until stopped; `use_uvloop` false runs it on asyncio's
    own loop (the benchmark compares the two). `workers` overrides `http: workers`; `worker`:
    run as one of a supervisor's workers."""
    try:
        config = load(config_path, GatewayConfig)
        count = worker_count(config.http.workers if workers is None else workers)
        if worker is None and count > 1:
            telemetry.setup("llmgw-gateway")
            # One id for the whole gateway, chosen once: a worker started again reports as
            # the one it replaces.
            supervisor = Supervisor(
                config_path, count, config.http.host, config.http.port, config.id or default_id()
            )
            anyio.run(supervisor.run)
            return 0
        if worker is not None:
            config = msgspec.structs.replace(
                config, id=worker.gateway_id, http=msgspec.structs.replace(config.http, port=worker.port)
            )
        telemetry.setup("llmgw-gateway", node=config.id if worker is not None else "")
        raise_open_file_limit()
        anyio.run(_main, config, worker, backend_options=loop_options(use_uvloop))
    except LlmgwError as exc:
        print(f"llmgw-gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="gateway.yaml")
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes serving the port (overrides http: workers; 0: one per CPU)",
    )
    # Set by the supervisor for each worker it starts, not by hand.
    for flag in ("--worker", "--port", "--ready-fd"):
        parser.add_argument(flag, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--id", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers {args.workers}: give the number of gateway processes (0: one per CPU)")
    worker = None
    if args.worker is not None:
        if args.port is None or args.ready_fd is None or not args.id or not args.run_dir:
            parser.error(
                "--worker is given by the workers' supervisor with --port, --id, --ready-fd and --run-dir"
            )
        worker = WorkerOf(args.worker, args.port, args.id, args.ready_fd, args.run_dir)
    sys.exit(run(args.config, workers=args.workers, worker=worker))


if __name__ == "__main__":
    main()
