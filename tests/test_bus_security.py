"""The bus client against a NATS server that wants TLS and a password, as production ones do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.errors import BusError
from llmgw_core.events import InstallProgress
from llmgw_core.natsd import NatsServer

pytestmark = pytest.mark.anyio


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    ca_key, ca, key, csr, cert = (
        d / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=llmgw-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=127.0.0.1",
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return ca, cert, key


@pytest.fixture
def secure_nats(tmp_path: Path) -> tuple[NatsServer, Path]:
    ca, cert, key = make_certs(tmp_path)
    server = NatsServer(
        store_dir=tmp_path / "nats",
        extra_config=(
            f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  ca_file: "{ca}"\n}}\n'
            "authorization {\n  user: llmgw\n  password: s3cret\n}\n"
        ),
    )
    server.start()
    yield server, ca
    server.stop()


async def test_tls_and_a_password_are_used(secure_nats: tuple[NatsServer, Path]) -> None:
    server, ca = secure_nats
    url = f"tls://127.0.0.1:{server.port}"
    options = BusOptions(url=url, prefix="sec", user="llmgw", password="s3cret", tls_ca=str(ca))
    bus = await Bus.connect(options, service="test")
    async with bus:
        await bus.ensure()
        await bus.put(
            bus.names.nodes_bucket, "n1", InstallProgress(node="n1", engine="e", step="s", message="m")
        )
        got = await bus.get(bus.names.nodes_bucket, "n1", InstallProgress)
        assert got is not None
        assert bus.nc.connected_url is not None
        assert bus.nc.connected_url.scheme == "tls"


async def test_a_wrong_password_is_refused_with_the_address_and_what_to_do(
    secure_nats: tuple[NatsServer, Path],
) -> None:
    server, ca = secure_nats
    url = f"tls://127.0.0.1:{server.port}"
    with pytest.raises(BusError) as err:
        await Bus.connect(
            BusOptions(url=url, user="llmgw", password="wrong", tls_ca=str(ca), connect_timeout_s=3),
            service="test",
        )
    assert str(err.value).startswith(f"test: cannot connect to NATS at {url} as user llmgw: ")
    assert "Authorization Violation" in str(err.value)
    assert "auth.conf" in str(err.value)
