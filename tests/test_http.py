"""The real agent under gunicorn on a loopback port: endpoints, methods, negotiation, shutdown."""

from __future__ import annotations

import errno
import gzip
import json
import socket
import subprocess
import threading
import time

import pytest
import requests

import scaffold
from agent import KEPLER_BRIDGE, Agent
from kepler_bridge.http import server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def agent():
    with Agent("--simulate", "2", "--interval", "0.5s", "--sources", "simulated") as running:
        yield running


def test_metrics_text_format_parses_and_has_node_label_everywhere(agent: Agent) -> None:
    response = agent.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = scaffold.families(response.text)
    assert {
        "gpu_utilization_ratio",
        "gpu_up",
        "kepler_bridge_source_up",
        "process_resident_memory_bytes",
    } <= set(families)
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("node") == "test-node", sample
    up = [s for s in families["gpu_up"].samples]
    assert [s.labels["gpu"] for s in up] == ["0", "1"] and all(s.value == 1 for s in up)


def test_openmetrics_negotiated_by_accept(agent: Agent) -> None:
    response = agent.get(
        "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    refused = "application/openmetrics-text;q=0, text/plain;version=0.0.4"
    for _ in range(2):  # the first may run the route, the second is the loop's cached answer
        text = agent.get("/metrics", headers={"Accept": refused})
        assert text.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def test_gzip_when_asked(agent: Agent) -> None:
    raw = requests.get(
        agent.url + "/metrics", headers={"Accept-Encoding": "gzip"}, stream=True, timeout=5
    )
    assert raw.headers["Content-Encoding"] == "gzip"
    body = gzip.decompress(raw.raw.read())
    assert b"gpu_up{" in body
    for path in ("/v1/collect", "/v1/collect", "/metrics", "/metrics"):
        for refused in ("identity", "identity, gzip;q=0"):
            plain = requests.get(agent.url + path, headers={"Accept-Encoding": refused}, timeout=5)
            assert "Content-Encoding" not in plain.headers, (path, refused)


def test_collect_follows_the_baetyl_contract(agent: Agent) -> None:
    response = agent.get("/v1/collect")
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    body = response.json()
    node = body["test-node"]
    assert node["deviceNum"] == 2 == len(node["devices"])
    for device in node["devices"]:
        assert isinstance(device["usedMemory"], int) and isinstance(device["totalMemory"], int)
        assert 0 <= device["percent"] <= 1
    assert node["usedMemory"] == sum(d["usedMemory"] for d in node["devices"])
    assert node["totalMemory"] == sum(d["totalMemory"] for d in node["devices"])
    assert node["percent"] == pytest.approx(node["usedMemory"] / node["totalMemory"])


def test_health_readiness_and_index(agent: Agent) -> None:
    assert agent.get("/healthz").json() == {"status": "ok"}
    ready = agent.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    page = agent.get("/")
    assert page.headers["Content-Type"].startswith("text/html")
    assert "test-node" in page.text and "simulated" in page.text and "/metrics" in page.text


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_only_get_and_head(agent: Agent, method: str) -> None:
    response = requests.request(method, agent.url + "/metrics", timeout=5)
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET, HEAD"
    assert response.json()["status"] == 405


def test_head_and_unknown_path(agent: Agent) -> None:
    head = requests.head(agent.url + "/v1/collect", timeout=5)
    assert head.status_code == 200 and head.content == b""
    missing = agent.get("/v2/nothing")
    assert missing.status_code == 404 and missing.json()["status"] == 404


def _head(port: int, request: bytes) -> bytes:
    """The status line and headers of the answer to one raw request, its Date taken out."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0]
    return b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"Date: "))


@pytest.mark.parametrize(
    "request_line, head",
    [
        (b"GET /healthz HTTP/1.1", b"200 OK|Content-Type: application/json|Content-Length: 15"),
        (b"HEAD /healthz HTTP/1.1", b"200 OK|Content-Type: application/json|Content-Length: 15"),
        (b"GET //healthz HTTP/1.1", b"200 OK|Content-Type: application/json|Content-Length: 15"),
        (
            b"GET /nope HTTP/1.1",
            b"404 NOT FOUND|Content-Type: application/json|Content-Length: 148",
        ),
        (
            b"DELETE /metrics HTTP/1.1",
            b"405 METHOD NOT ALLOWED|Content-Type: application/json|Content-Length: 76|"
            b"Allow: GET, HEAD",
        ),
    ],
)
def test_response_heads_are_the_ones_flask_sent(
    agent: Agent, request_line: bytes, head: bytes
) -> None:
    """The routes run on a WSGI app of our own, not Flask: the same status lines (Werkzeug's
    capitals), the same headers in the same order after gunicorn's own."""
    status, *headers = head.split(b"|")
    expected = [b"HTTP/1.1 " + status, b"Server: gunicorn", b"Connection: keep-alive", *headers]
    answer = _head(agent.port, request_line + b"\r\nHost: x\r\n\r\n")
    assert answer.split(b"\r\n") == expected


def test_head_has_the_headers_of_get_and_no_body(agent: Agent) -> None:
    for path in ("/metrics", "/v1/collect", "/", "/api/v1/history", "/nope"):
        got = requests.get(agent.url + path, headers={"Accept-Encoding": "gzip"}, timeout=5)
        head = requests.head(agent.url + path, headers={"Accept-Encoding": "gzip"}, timeout=5)
        assert head.status_code == got.status_code and head.content == b"", path
        for name in ("Content-Type", "Content-Encoding", "Vary", "Content-Security-Policy"):
            assert head.headers.get(name) == got.headers.get(name), (path, name)


def test_snapshot_is_fresh_and_values_move(agent: Agent) -> None:
    def sample_time() -> float:
        found = scaffold.samples(agent.metrics(), "kepler_bridge_last_sample_timestamp_seconds")
        assert found, "no timestamp"
        return found[0].value

    first = sample_time()
    agent.wait_for(lambda: sample_time() > first, what="a newer sample")


def test_hundred_concurrent_clients_for_ten_seconds_no_error(agent: Agent) -> None:
    errors: list[str] = []
    counts = [0] * 100
    deadline = time.monotonic() + 10

    def client(slot: int) -> None:
        session = requests.Session()
        paths = ("/metrics", "/v1/collect")
        while time.monotonic() < deadline:
            try:
                response = session.get(agent.url + paths[counts[slot] % 2], timeout=10)
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text[:80]}")
            except requests.RequestException as err:
                errors.append(repr(err))
            counts[slot] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors[:5]
    assert sum(counts) > 200


def test_bad_requests_are_answered_and_logged_once_without_their_text() -> None:
    with Agent("--simulate", "1", "--sources", "simulated") as agent:
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nAuthorization Bearer s3cret\r\n\r\n")
                assert sock.recv(64).startswith(b"HTTP/1.1 400 ")
        log = agent.output()
    assert "s3cret" not in log
    assert log.count("bad request from 127.0.0.1: InvalidHeader") == 1, log


def test_port_in_use_is_one_line_and_exit_1(agent: Agent) -> None:
    result = subprocess.run(
        [KEPLER_BRIDGE, "serve", "--listen", f"127.0.0.1:{agent.port}"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "address already in use" in line and "--listen" in line


def test_no_host_listens_on_ipv6_and_ipv4_and_names_ipv4_clients_plainly() -> None:
    agent = Agent("--simulate", "1", "--sources", "simulated")
    agent.args += ["--listen", f":{agent.port}"]  # the default's form: no host
    with agent:
        for host in ("127.0.0.1", "::1"):  # bad requests are logged once a minute: IPv4 first
            with socket.create_connection((host, agent.port), timeout=5) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(64).startswith(b"HTTP/1.1 200 "), host
            with socket.create_connection((host, agent.port), timeout=5) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nNo colon\r\n\r\n")
                assert sock.recv(64).startswith(b"HTTP/1.1 400 "), host
        agent.wait_for(lambda: "bad request from 127.0.0.1:" in agent.output(), what="the log")
        assert "::ffff:" not in agent.output()


def test_without_ipv6_no_host_listens_on_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object) -> socket.socket:
        if family == socket.AF_INET6:  # as a kernel booted with ipv6.disable=1 answers
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    port = scaffold.free_port()
    sock = server.bind(scaffold.make_config(listen=f":{port}"))
    with sock:
        assert sock.family == socket.AF_INET and sock.getsockname() == ("0.0.0.0", port)


def test_sigterm_stops_within_two_seconds() -> None:
    with Agent("--simulate", "1", "--sources", "simulated") as running:
        assert running.stop() < 2.0
        assert running.process.returncode == 0


def test_sigterm_during_an_unread_answer_still_ends_the_running_command(tmp_path) -> None:
    plugin = tmp_path / "plugin.sh"
    plugin.write_text("#!/bin/sh\nsleep 300\n")
    marker = str(plugin)  # the shell's command line while it waits
    plugin.chmod(0o755)
    args = ("--simulate", "16", "--sources", "simulated,command", "--command", str(plugin))
    with Agent(*args, "--command-timeout", "120s", ready=False) as running:
        running.wait_for(lambda: subprocess.run(["pgrep", "-f", marker]).returncode == 0)
        with socket.create_connection(("127.0.0.1", running.port)) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            reader.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
            time.sleep(1)
            running.stop()
            assert "Worker exiting" in running.output(), "the worker was killed"
    assert subprocess.run(["pgrep", "-f", marker]).returncode == 1, "the command was left"


def test_bearer_token_protects_metrics(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with Agent("--simulate", "1", "--auth-token-file", str(token)) as running:
        refused = running.get("/metrics")
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == (
            'Bearer realm="kepler-bridge"'
        )
        assert running.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        for scheme in ("Bearer", "bearer"):
            answer = running.get("/metrics", headers={"Authorization": f"{scheme} s3cret"})
            assert answer.status_code == 200, scheme
        assert running.get("/v1/collect").status_code == 200


def test_no_accelerator_gives_empty_device_list() -> None:
    with Agent(
        "--sources", "nvml", "--nvml-library", "/nonexistent/libnvidia-ml.so.1", ready=False
    ) as running:
        # /healthz answers as soon as the worker serves; the first sample may still be running.
        running.wait_for(lambda: running.get("/metrics").ok, timeout=30, what="the first sample")
        body = running.get("/v1/collect").json()
        assert body == {
            "test-node": {
                "deviceNum": 0,
                "devices": [],
                "usedMemory": 0,
                "totalMemory": 0,
                "percent": 0,
            }
        }
        ready = running.get("/readyz")
        assert ready.status_code == 503
        assert "nvml" in ready.json()["reason"] and "does not exist" in ready.json()["reason"]
        assert json.loads(running.get("/healthz").text)["status"] == "ok"
