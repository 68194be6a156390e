"""The HTTPS server context: a real TLS handshake in memory, and the floor of TLS 1.2."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from kepler_bridge.http.tls import TLSError, server_context
from kubefakes import self_signed


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> str:
    """Run a TLS handshake between the two contexts over memory buffers; the agreed version."""
    to_server, to_client, from_server, from_client = (ssl.MemoryBIO() for _ in range(4))
    server_end = server.wrap_bio(to_server, from_server, server_side=True)
    client_end = client.wrap_bio(to_client, from_client, server_hostname="127.0.0.1")
    for _ in range(10):
        for end in (client_end, server_end):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
        to_server.write(from_client.read())
        to_client.write(from_server.read())
        if client_end.version() and server_end.version():
            return client_end.version()
    raise AssertionError("the handshake did not finish")


def test_server_context_serves_its_certificate_with_tls_1_2_or_newer(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server = server_context(str(cert), str(key))
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    client = ssl.create_default_context(cafile=str(cert))
    assert handshake(server, client) in ("TLSv1.2", "TLSv1.3")
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    assert handshake(server, client) == "TLSv1.2"


def test_error_names_the_file_at_fault(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with pytest.raises(TLSError, match="not a PEM certificate") as err:
        server_context(str(key), str(key))
    assert err.value.part == "cert"
    with pytest.raises(TLSError, match="cannot read the file: No such file") as err:
        server_context(str(cert), str(tmp_path / "missing.key"))
    assert err.value.part == "key"
