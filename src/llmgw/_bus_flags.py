"""The flags that say how to reach a cluster's bus, one definition for every command that
connects to it (`llmgw ctl`, `llmgw fleet`), and the BusOptions they describe. argparse
only: building a parser imports nothing heavy."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw_core.bus import BusOptions


def add_bus_flags(p: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """--nats-url, --prefix, the identity (--nkey or --insecure) and TLS. With `suppress`, no
    defaults: a subcommand's copy then leaves what its parent's flags set (`llmgw ctl get
    nodes --prefix x` works as well as `llmgw ctl --prefix x get nodes`)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "--nats-url",
        default=default(""),
        metavar="URL",
        help="the cluster's NATS (default: LLMGW_NATS_URL, else nats://127.0.0.1:4222)",
    )
    p.add_argument(
        "--prefix", default=default("llmgw"), help="subject prefix of the cluster (default: llmgw)"
    )
    p.add_argument(
        "--nkey",
        default=default(""),
        metavar="SEED_FILE",
        help="the identity's nkey seed file (default: LLMGW_NATS_NKEY)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=default(False),
        help="connect without credentials, to a cluster that runs without authentication "
        "(LLMGW_NATS_INSECURE=1 does the same)",
    )
    p.add_argument("--tls-ca", default=default(""), help="CA of the NATS server's certificate")
    p.add_argument(
        "--tls-cert", default=default(""), help="client certificate, where the server asks for one"
    )
    p.add_argument("--tls-key", default=default(""), help="the client certificate's key")


def bus_options(args: argparse.Namespace) -> BusOptions:
    """The NATS connection that these flags (and the LLMGW_NATS_* variables) describe."""
    from llmgw_core.bus import BusOptions

    return BusOptions(
        url=args.nats_url,
        prefix=args.prefix,
        nkey_seed_file=args.nkey,
        insecure=args.insecure,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
