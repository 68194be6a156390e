"""Slow, silent, non-reading and malformed clients against the real agent.

Probes are still answered.
"""

from __future__ import annotations

import socket
import ssl
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import Agent
from hostile_clients import REQUEST, Attack, closed_by_peer
from kubefakes import self_signed

HEADER_TIMEOUT = 2.0
WRITE_TIMEOUT = 3.0
# How late the agent may notice a timeout (it checks deadlines every 0.25 s) plus scheduling slack.
SLACK = 3.0
PROBES = ("/metrics", "/v1/collect", "/healthz", "/readyz")


pytestmark = pytest.mark.e2e


def _agent(*args: str, ca: str = "") -> Agent:
    return Agent(
        "--simulate",
        "2",
        "--sources",
        "simulated",
        "--interval",
        "0.5s",
        "--http-header-timeout",
        f"{HEADER_TIMEOUT}s",
        "--http-write-timeout",
        f"{WRITE_TIMEOUT}s",
        *args,
        ca=ca,
    )


@pytest.fixture(scope="module")
def hostile_agent():
    with _agent() as running:
        yield running


def _wait_closed(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets the server has not closed after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        open_ = [sock for sock in open_ if not closed_by_peer(sock)]
        time.sleep(0.1)
    return open_


def test_probes_answered_while_slowloris_and_non_readers_hold_connections() -> None:
    with (
        _agent() as agent,
        Attack(agent.port, silent=100, dripping=100, non_readers=20, max_seconds=60),
    ):
        answered = 0
        deadline = time.monotonic() + 2 * HEADER_TIMEOUT
        while time.monotonic() < deadline:
            for path in PROBES:
                # The old threaded worker never answered here:
                # every thread waited on a dripping client.
                assert requests.get(agent.url + path, timeout=5).status_code == 200, path
                answered += 1
        assert answered >= len(PROBES)


def test_silent_and_dripping_connections_are_closed_after_the_header_timeout() -> None:
    with _agent() as agent, Attack(agent.port, silent=20, dripping=20, drip_every=0.2) as attack:
        still_open = _wait_closed(attack.silent + attack.dripping, HEADER_TIMEOUT + SLACK)
        assert not still_open, f"{len(still_open)} of 40 slow connections still open"


def test_a_client_that_never_reads_is_closed_after_the_write_timeout() -> None:
    with _agent() as agent, Attack(agent.port, non_readers=5, pipelined=400) as attack:
        time.sleep(WRITE_TIMEOUT + SLACK)
        still_open = _wait_closed(attack.non_readers, 10)
        assert not still_open, f"{len(still_open)} of 5 non-reading connections still open"
        assert requests.get(agent.url + "/healthz", timeout=5).status_code == 200


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    with _agent() as agent, socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(
            b"".join(
                f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                for path in ("/healthz", "/nope", "/healthz")
            )
        )
        reader = sock.makefile("rb")
        statuses = []
        for _ in range(3):
            statuses.append(reader.readline().split()[1])
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
        assert statuses == [b"200", b"404", b"200"]


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """The status codes of the next `count` answers on `sock`; fewer where it closes first."""
    reader, statuses = sock.makefile("rb"), []
    for _ in range(count):
        status = reader.readline().split()
        if not status:
            break
        statuses.append(status[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reader.read(length)
    return statuses


def test_heads_whose_lines_end_in_a_bare_lf_are_answered_as_node_exporter_answers_them(
    hostile_agent: Agent,
) -> None:
    """`printf 'GET /metrics HTTP/1.0\\n\\n' | nc` gets the metrics, as from node_exporter;
    pipelined and mixed line ends too. A bare CR is still refused."""
    with socket.create_connection(("127.0.0.1", hostile_agent.port), timeout=5) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\nHost: x\n\n"
            b"GET /nope HTTP/1.1\r\nHost: x\n\r\n"
            b"GET /healthz HTTP/1.1\nHost: x\r\n\n"
        )
        assert _answers(sock, 3) == [b"200", b"404", b"200"]
    with socket.create_connection(("127.0.0.1", hostile_agent.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\n\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 200"), answer[:80]
    assert b"\ngpu_up{" in answer
    with socket.create_connection(("127.0.0.1", hostile_agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\rHost: x\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400")


def test_pipelined_requests_behind_an_answer_the_client_reads_slowly_are_all_answered(
    hostile_agent: Agent,
) -> None:
    """A big answer the client takes its time to read waits for it to be sent; the small ones
    pipelined behind it are answered at once, each in turn, and the connection stays open."""
    paths = ("/metrics", "/healthz", "/healthz", "/healthz", "/v1/collect", "/healthz")
    for _ in range(5):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(5)
            sock.connect(("127.0.0.1", hostile_agent.port))
            sock.sendall(
                b"".join(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % p.encode() for p in paths)
            )
            time.sleep(0.3)  # the first answer does not fit the client's window meanwhile
            assert _answers(sock, len(paths)) == [b"200"] * len(paths)


def test_a_tls_client_reading_steadily_gets_an_answer_longer_than_the_write_timeout(
    tmp_path,
) -> None:
    """The write timeout is for a client that stops reading: over TLS, as over plain HTTP, each
    record the client takes restarts it, however long the whole answer takes."""
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    with (
        _agent(
            "--simulate", "8", "--tls-cert", str(cert), "--tls-key", str(key), ca=str(cert)
        ) as agent,
        socket.socket() as raw,
    ):
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.settimeout(10)
        raw.connect(("127.0.0.1", agent.port))
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            started, received = time.monotonic(), b""
            while chunk := tls.recv(1024):
                received += chunk
                time.sleep(0.1)  # some 10 KB/s: the answer takes longer than the write timeout
            took = time.monotonic() - started
    head, _, body = received.partition(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if b"ength:" in line]
    assert length == [len(body)], f"{len(body)} bytes of {length} in {took:.1f} s"
    assert took > WRITE_TIMEOUT + 1, f"the answer took {took:.1f} s only: read more slowly"


def test_a_request_with_a_body_is_refused_and_the_connection_closed() -> None:
    with _agent() as agent, socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 405")


def test_an_oversized_request_head_gets_431() -> None:
    with _agent() as agent, socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        try:
            sock.sendall(b"GET / HTTP/1.1\r\n" + b"X-Filler: " + b"a" * 100_000)
        except OSError:
            pass  # the server may close before taking it all
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:80]


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(
    garbage=st.one_of(
        st.binary(max_size=2048),
        st.builds(
            lambda line, tail: line + b"\r\n" + tail + b"\r\n\r\n",
            st.sampled_from(
                [
                    b"GET / HTTP/1.1",
                    b"GET /metrics HTTP/9.9",
                    b"\x00\xff / HTTP/1.1",
                    b"GET " + b"/" * 9000 + b" HTTP/1.1",
                    b"BREW /pot HTCPCP/1.0",
                ]
            ),
            st.binary(max_size=512),
        ),
    )
)
def test_arbitrary_bytes_never_take_the_server_down(hostile_agent: Agent, garbage: bytes) -> None:
    with socket.create_connection(("127.0.0.1", hostile_agent.port), timeout=5) as sock:
        try:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(64)
        except OSError:
            answer = b""
    assert answer == b"" or answer.startswith(b"HTTP/1."), answer
    assert requests.get(hostile_agent.url + "/healthz", timeout=5).status_code == 200


def test_https_serves_and_a_client_that_never_handshakes_does_not_block_it(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    with _agent("--tls-cert", str(cert), "--tls-key", str(key), ca=str(cert)) as agent:
        stalled = [
            socket.create_connection(("127.0.0.1", agent.port), timeout=5) for _ in range(10)
        ]
        for path in PROBES:
            assert agent.get(path).status_code == 200, path
        with pytest.raises(
            requests.ConnectionError
        ):  # plain HTTP to the TLS port: refused, not hung
            requests.get(f"http://127.0.0.1:{agent.port}/healthz", timeout=5)
        assert not _wait_closed(stalled, HEADER_TIMEOUT + SLACK)
        for sock in stalled:
            sock.close()
        context = ssl.create_default_context(cafile=str(cert))
        with (
            socket.create_connection(("127.0.0.1", agent.port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(REQUEST * 3)
            received = b""
            while received.count(b"HTTP/1.1 200") < 3:
                chunk = tls.recv(1 << 16)
                assert chunk, "connection closed before three pipelined answers"
                received += chunk
