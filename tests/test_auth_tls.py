"""TLS between llmgw and NATS, with a CA and certificates the test makes (trustme): the server's
certificate is checked against the CA the client is given, and with `verify` the server asks for
the client's own certificate (mutual TLS). Identities work the same over it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from llmgw.auth import AuthDir
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.errors import BusError
from llmgw_core.events import NodeFacts, NodeStatus, now
from llmgw_core.natsd import NatsServer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("node-gpu-1@llmgw")
    d = tmp_path / "pki"
    d.mkdir()
    paths = Pki(
        *(d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem"))
    )
    ca.cert_pem.write_to_path(str(paths.ca))
    server.private_key_pem.write_to_path(str(paths.server_key))
    server.cert_chain_pems[0].write_to_path(str(paths.server_cert))
    client.private_key_pem.write_to_path(str(paths.client_key))
    client.cert_chain_pems[0].write_to_path(str(paths.client_cert))
    trustme.CA().cert_pem.write_to_path(str(paths.other_ca))
    return paths


def tls_block(pki: Pki, *, verify: bool) -> str:
    # The same block docs/security.md shows; `verify: true` makes it mutual.
    return (
        "tls {\n"
        f'  cert_file: "{pki.server_cert}"\n'
        f'  key_file: "{pki.server_key}"\n'
        f'  ca_file: "{pki.ca}"\n'
        f"  verify: {'true' if verify else 'false'}\n"
        "  timeout: 2\n"
        "}\n"
    )


@pytest.fixture
def identities(tmp_path: Path) -> AuthDir:
    auth = AuthDir(tmp_path / "auth")
    auth.init(["gpu-1"], prefix="tls")
    return auth


@contextlib.contextmanager
def tls_server(pki: Pki, identities: AuthDir, store: Path, *, verify: bool) -> Iterator[NatsServer]:
    nats = NatsServer(
        store_dir=store, extra_config=tls_block(pki, verify=verify), includes=(identities.conf,)
    )
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()


@pytest.fixture(params=[False, True], ids=["tls", "mutual-tls"])
def server(
    request: pytest.FixtureRequest, pki: Pki, identities: AuthDir, tmp_path: Path
) -> Iterator[NatsServer]:
    with tls_server(pki, identities, tmp_path / "nats", verify=request.param) as nats:
        yield nats


@pytest.fixture
def mutual_server(pki: Pki, identities: AuthDir, tmp_path: Path) -> Iterator[NatsServer]:
    with tls_server(pki, identities, tmp_path / "nats", verify=True) as nats:
        yield nats


def options(server: NatsServer, auth: AuthDir, name: str, **tls: str) -> BusOptions:
    return BusOptions(
        url=f"tls://127.0.0.1:{server.port}",
        prefix="tls",
        nkey_seed_file=str(auth.seed(name)),
        connect_timeout_s=30,
        **tls,
    )


def mutual(server: NatsServer) -> bool:
    return "verify: true" in server.extra_config


async def test_with_the_ca_placement_and_a_node_do_their_work(
    server: NatsServer, pki: Pki, identities: AuthDir
) -> None:
    client_cert = {"tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)} if mutual(server) else {}
    async with await Bus.connect(
        options(server, identities, "placement", tls_ca=str(pki.ca), **client_cert), service="placement"
    ) as placement:
        await placement.ensure()
    async with await Bus.connect(
        options(server, identities, "node-gpu-1", tls_ca=str(pki.ca), **client_cert),
        service="installer-gpu-1",
    ) as node:
        status = NodeStatus(node="gpu-1", facts=NodeFacts(node="gpu-1"), updated_at=now())
        await node.put(node.names.nodes_bucket, "gpu-1", status)
        assert node.nc.connected_url is not None
        assert node.nc.connected_url.scheme == "tls"
    async with await Bus.connect(
        options(server, identities, "placement", tls_ca=str(pki.ca), **client_cert), service="placement"
    ) as placement:
        got = await placement.get(placement.names.nodes_bucket, "gpu-1", NodeStatus)
        assert got is not None
        assert got[0] == status


@pytest.mark.timeout(20)
async def test_without_the_servers_ca_the_client_refuses_the_server(
    server: NatsServer, pki: Pki, identities: AuthDir
) -> None:
    for tls in ({}, {"tls_ca": str(pki.other_ca)}):
        with pytest.raises(BusError) as err:
            await Bus.connect(options(server, identities, "placement", **tls), service="placement")
        message = str(err.value)
        assert message.startswith(
            f"placement: cannot connect to NATS at tls://127.0.0.1:{server.port} as placement ("
        )
        assert "CERTIFICATE_VERIFY_FAILED" in message
        assert message.endswith(
            "TLS failed: set nats: tls_ca to the CA that signed the server's certificate, and tls_cert and "
            "tls_key where the server asks for client certificates"
        )


@pytest.mark.timeout(20)
async def test_mutual_tls_refuses_a_client_without_a_certificate(
    mutual_server: NatsServer, pki: Pki, identities: AuthDir
) -> None:
    with pytest.raises(BusError) as err:
        await Bus.connect(
            options(mutual_server, identities, "placement", tls_ca=str(pki.ca)), service="placement"
        )
    assert str(err.value).startswith(
        f"placement: cannot connect to NATS at tls://127.0.0.1:{mutual_server.port} as placement ("
    )
    assert "CERTIFICATE_REQUIRED" in str(err.value)
    assert "tls_cert and tls_key where the server asks for client certificates" in str(err.value)
