"""The HTTPS server context: a real TLS handshake in memory, the floor of TLS 1.2, and broken
certificate files (DER, empty, garbage, another key) at start-up and swapped in while running."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import pytest
import yaml

from agent import KEPLER_BRIDGE, Agent
from kepler_bridge.http.tls import TLSError, server_context
from kubefakes import self_signed
from pki import Authority, der


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


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A server certificate and key for 127.0.0.1, its CA, and the broken files an operator may
    give instead: DER forms, an empty file, garbage and the key of another certificate."""
    directory = tmp_path_factory.mktemp("pairs")
    ca = Authority(directory / "ca")
    cert, key = ca.issue("server", "IP:127.0.0.1")
    renewed_cert, renewed_key = ca.issue("renewed", "IP:127.0.0.1")
    empty, garbage = directory / "empty.pem", directory / "garbage.pem"
    empty.write_bytes(b"")
    garbage.write_bytes(bytes(range(256)) * 4)
    return {
        "ca": ca.cert,
        "cert": cert,
        "key": key,
        "renewed cert": renewed_cert,
        "renewed key": renewed_key,
        "der cert": der(cert),
        "der key": der(key, "pkey"),
        "empty": empty,
        "garbage": garbage,
    }


# (cert, key, the setting at fault, what its line says): each a file an operator may give.
BROKEN = [
    ("der cert", "key", "cert", "openssl x509 -inform der -in"),
    ("cert", "der key", "key", "openssl pkey -inform der -in"),
    ("der cert", "der key", "cert", "openssl x509 -inform der -in"),
    ("empty", "key", "cert", "the file is empty"),
    ("cert", "empty", "key", "the file is empty"),
    ("garbage", "key", "cert", "not a PEM certificate"),
    ("cert", "garbage", "key", "not a PEM private key"),
    ("cert", "renewed key", "key", "does not belong to the certificate"),
]


def _start_line(*args: str) -> str:
    """The one stderr line of a refused `kepler-bridge ARGS`, asserting exit 2."""
    run = subprocess.run(
        [KEPLER_BRIDGE, *args, "--sources", "simulated", "--simulate", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    return run.stderr.strip()


@pytest.mark.e2e
def test_broken_tls_flags_are_one_line_and_exit_2_naming_the_fix(pairs: dict[str, Path]) -> None:
    for cert, key, part, says in BROKEN:
        command = "doctor" if part == "cert" else "serve"
        line = _start_line(command, "--tls-cert", str(pairs[cert]), "--tls-key", str(pairs[key]))
        path = pairs[cert] if part == "cert" else pairs[key]
        assert f"tls_{part}='{path}' (from --tls-{part})" in line and says in line, (
            cert,
            key,
            line,
        )


@pytest.mark.e2e
def test_broken_web_config_certificates_are_one_line_and_exit_2(
    pairs: dict[str, Path], tmp_path: Path
) -> None:
    for cert, key, part, says in BROKEN[:4]:
        web = tmp_path / "web.yml"
        tls = {"cert_file": str(pairs[cert]), "key_file": str(pairs[key])}
        web.write_text(yaml.safe_dump({"tls_server_config": tls}))
        for command in ("serve", "doctor"):
            line = _start_line(command, "--web.config.file", str(web))
            assert f"web_config_file='{web}' (from --web-config-file)" in line, line
            assert f"tls_server_config.{part}_file" in line and says in line, (cert, key, line)


def _served(port: int, ca: Path) -> bytes:
    """The certificate a new TLS connection to the agent is served (verified by `ca`)."""
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert tls.recv(64).startswith(b"HTTP/1.1 200"), "no answer over the kept certificate"
        return tls.getpeercert(binary_form=True)


def _restart_while_broken(agent: Agent, pairs: dict[str, Path], cert: Path) -> None:
    """A worker that restarts while a DER file is in place keeps serving the pair the agent
    started with (the master hands it the files as they were then)."""
    first = _served(agent.port, pairs["ca"])
    cert.write_bytes(pairs["der cert"].read_bytes())
    (worker,) = agent.worker_pids()
    os.kill(worker, signal.SIGKILL)
    agent.wait_for(lambda: agent.worker_pids() not in ([], [worker]), what="a new worker")
    agent.wait_for(lambda: _served(agent.port, pairs["ca"]) == first, what="the kept pair")
    cert.write_bytes(pairs["cert"].read_bytes())


def _swap_in_broken_files(agent: Agent, pairs: dict[str, Path], cert: Path, key: Path) -> None:
    """Each broken file in turn: new connections keep the last good certificate, one warning
    each, no traceback; then a good renewal is served."""
    first = _served(agent.port, pairs["ca"])
    for broken_cert, broken_key, _part, says in BROKEN:
        cert.write_bytes(pairs[broken_cert].read_bytes())
        key.write_bytes(pairs[broken_key].read_bytes())
        logged = agent.output().count("not reloaded")
        for _ in range(3):
            assert _served(agent.port, pairs["ca"]) == first, (broken_cert, broken_key)
        agent.wait_for(lambda: agent.output().count("not reloaded") > logged, what="a warning")
        warnings = [line for line in agent.output().splitlines() if "not reloaded" in line]
        assert len(warnings) == logged + 1 and says in warnings[-1], warnings
    assert "Traceback" not in agent.output()
    cert.write_bytes(pairs["renewed cert"].read_bytes())
    key.write_bytes(pairs["renewed key"].read_bytes())
    agent.wait_for(lambda: _served(agent.port, pairs["ca"]) != first, what="the renewal served")


@pytest.mark.e2e
def test_tls_flags_swapped_to_broken_files_keep_the_last_good_pair(
    pairs: dict[str, Path], tmp_path: Path
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pairs["cert"].read_bytes())
    key.write_bytes(pairs["key"].read_bytes())
    flags = ("--simulate", "1", "--sources", "simulated", "--interval", "0.5s")
    with Agent(
        *flags, "--tls-cert", str(cert), "--tls-key", str(key), ca=str(pairs["ca"])
    ) as agent:
        _restart_while_broken(agent, pairs, cert)
        _swap_in_broken_files(agent, pairs, cert, key)


@pytest.mark.e2e
def test_web_config_certificates_swapped_to_broken_files_keep_the_last_good_pair(
    pairs: dict[str, Path], tmp_path: Path
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pairs["cert"].read_bytes())
    key.write_bytes(pairs["key"].read_bytes())
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}})
    )
    flags = ("--simulate", "1", "--sources", "simulated", "--interval", "0.5s")
    with Agent(*flags, "--web.config.file", str(web), ca=str(pairs["ca"])) as agent:
        _restart_while_broken(agent, pairs, cert)
        _swap_in_broken_files(agent, pairs, cert, key)
