"""The event loop's own answers from the render cache (issue 18): the bytes the views give, to
every request they cover, and given while every pool thread is busy."""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from gunicorn.config import Config as GunicornConfig

from agent import Agent
from kepler_bridge.http.app import WebSettings, create_app
from kepler_bridge.http.webconfig import WebConfigFile
from kepler_bridge.http.wsgi import Peer, WsgiBridge, cached_answers
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore
from scaffold import make_config

PEER = Peer(("127.0.0.1", 40000), ("127.0.0.1", 9102), False)
TOKEN = "s3cret"
# Ways a scraper asks: each of these heads' answers comes from the loop once the bytes are made.
ASKING = (
    "",
    "Accept-Encoding: gzip\r\n",
    "Accept: application/openmetrics-text; version=1.0.0\r\nAccept-Encoding: gzip, deflate\r\n",
    "Connection: close\r\n",
    "Connection: keep-alive\r\nUser-Agent: Prometheus/2.53\r\n"
    "X-Prometheus-Scrape-Timeout-Seconds: 10\r\n",
    "Expect: 100-continue\r\n",
    "Accept: text/plain\r\nAccept: application/openmetrics-text\r\n",
)
VERSIONS = ("HTTP/1.1", "HTTP/1.0")
METHODS = ("GET", "HEAD")
PATHS = ("/metrics", "/metrics?name=x", "/v1/collect", "/healthz", "/readyz")
DATE = re.compile(rb"\r\nDate: [^\r]*")


def _raise(req: Any, client: Any, addr: Any, exc: Exception) -> None:
    raise exc


def _bridge(tmp_path: Path, token: bool = False, users: bool = False) -> WsgiBridge:
    """The worker's WSGI bridge on the real app, with one sample of 2 simulated GPUs published."""
    settings: dict[str, object] = {"sources": "simulated", "simulate": 2, "kube_source": "off"}
    if token:
        (tmp_path / "token").write_text(TOKEN)
        settings["auth_token_file"] = tmp_path / "token"
    web = None
    if users:
        hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(4)).decode()
        (tmp_path / "web.yml").write_text(yaml.safe_dump({"basic_auth_users": {"alice": hashed}}))
        web = WebConfigFile(str(tmp_path / "web.yml"))
    config = make_config(**settings)
    store = SnapshotStore()
    store.publish(Sampler(config, store).sample())
    app = create_app(store, lambda: WebSettings.of(config), web=web)
    return WsgiBridge(app, GunicornConfig(), _raise, lambda: True, cached_answers(app))


def _head(method: str, path: str, version: str, headers: str) -> bytes:
    return f"{method} {path} {version}\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode()


def _undated(chunks: list[bytes]) -> bytes:
    return DATE.sub(b"\r\nDate: -", b"".join(chunks))


def _both(bridge: WsgiBridge, head: bytes) -> tuple[tuple[bytes, bool] | None, bytes, bool]:
    """The loop's answer (None: the view must answer) and the view's, with no Date."""
    view_chunks, view_keepalive = bridge.answer(head, PEER)  # renders what the loop may serve
    found = bridge.answer_cached(head, PEER)
    loop = None if found is None else (_undated(found[0]), found[1])
    return loop, _undated(view_chunks), view_keepalive


def test_the_loop_answers_every_way_of_asking_with_the_bytes_the_views_give(tmp_path: Path) -> None:
    bridge = _bridge(tmp_path)
    for path in PATHS:
        for method in METHODS:
            for version in VERSIONS:
                for headers in ASKING:
                    head = _head(method, path, version, headers)
                    loop, view, keepalive = _both(bridge, head)
                    assert loop == (view, keepalive), head


@pytest.mark.parametrize(
    "head",
    [
        _head("GET", "/%6detrics", "HTTP/1.1", ""),  # the same view, by a path the loop leaves
        _head("GET", "/readyz", "HTTP/1.1", "Authorization: Basic YWxpY2U6cmlnaHQ=\r\n"),
        _head("GET", "/", "HTTP/1.1", ""),
        _head("POST", "/metrics", "HTTP/1.1", "Content-Length: 0\r\n"),
        _head("OPTIONS", "/metrics", "HTTP/1.1", ""),
        _head("GET", "/metrics", "HTTP/1.1", "Content-Length: 5\r\n"),
        _head("GET", "/metrics", "HTTP/1.1", "Bad Header: x\r\n"),
        b"\r\n\r\n",
    ],
)
def test_requests_the_loop_is_not_certain_of_go_to_the_views(tmp_path: Path, head: bytes) -> None:
    assert _bridge(tmp_path).answer_cached(head, PEER) is None


def test_a_guarded_metrics_is_answered_by_the_loop_only_with_the_right_token(
    tmp_path: Path,
) -> None:
    bridge = _bridge(tmp_path, token=True)
    right = _head("GET", "/metrics", "HTTP/1.1", f"Authorization: Bearer {TOKEN}\r\n")
    loop, view, keepalive = _both(bridge, right)
    assert loop == (view, keepalive) and b" 200 OK\r\n" in view
    for wrong in ("", "Authorization: Bearer nope\r\n", f"Authorization: Bearer {TOKEN}x\r\n"):
        loop, view, _ = _both(bridge, _head("GET", "/metrics", "HTTP/1.1", wrong))
        assert loop is None and b" 401 " in view, wrong
    # The probes and /v1/collect need no token, as in the views.
    for path in ("/healthz", "/v1/collect"):
        loop, view, keepalive = _both(bridge, _head("GET", path, "HTTP/1.1", ""))
        assert loop == (view, keepalive) and b" 200 OK\r\n" in view


def test_basic_auth_is_always_the_views_to_check(tmp_path: Path) -> None:
    bridge = _bridge(tmp_path, users=True)
    for user in ("alice:right", "alice:wrong", ""):
        header = f"Authorization: Basic {_basic(user)}\r\n" if user else ""
        loop, _, _ = _both(bridge, _head("GET", "/metrics", "HTTP/1.1", header))
        assert loop is None, user
    loop, view, keepalive = _both(bridge, _head("GET", "/healthz", "HTTP/1.1", ""))
    assert loop == (view, keepalive)


def test_nothing_comes_from_the_loop_before_the_bytes_are_made(tmp_path: Path) -> None:
    bridge = _bridge(tmp_path)
    for headers in ASKING[:3]:
        assert bridge.answer_cached(_head("GET", "/metrics", "HTTP/1.1", headers), PEER) is None
    assert bridge.answer_cached(_head("GET", "/v1/collect", "HTTP/1.1", ""), PEER) is None


def _basic(credentials: str) -> str:
    return base64.b64encode(credentials.encode()).decode()


def _send(port: int, head: bytes, answers: list[tuple[str, float]], name: str) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        sock.recv(1)
        answers.append((name, time.monotonic()))


@pytest.mark.e2e
def test_probes_and_collect_are_answered_while_every_pool_thread_checks_a_password(
    tmp_path: Path,
) -> None:
    # Four password checks of a costly hash hold the four pool threads (two run bcrypt, two wait
    # for a slot). Before the fix every request waited for a pool thread: the probes came last.
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(13)).decode()
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"alice": hashed}}))
    # One sample in the test's time: the bytes made for it stay the newest.
    flags = ("--simulate", "2", "--sources", "simulated", "--interval", "60s")
    with Agent(*flags, "--web.config.file", str(web)) as agent:
        for path in ("/healthz", "/v1/collect"):
            agent.get(path)  # its bytes made
        answers: list[tuple[str, float]] = []
        wrong = [f"Authorization: Basic {_basic(f'user{n}:wrong')}\r\n" for n in range(4)]
        checks = [
            threading.Thread(
                target=_send,
                args=(agent.port, _head("GET", "/metrics", "HTTP/1.1", header), answers, header),
            )
            for header in wrong
        ]
        for check in checks:
            check.start()
        time.sleep(0.2)  # the checks reach the pool
        for path in ("/healthz", "/v1/collect", "/readyz"):
            _send(agent.port, _head("GET", path, "HTTP/1.1", ""), answers, path)
        for check in checks:
            check.join()
    order = [name for name, _ in sorted(answers, key=lambda answer: answer[1])]
    assert order[:3] == ["/healthz", "/v1/collect", "/readyz"], order


def test_a_probe_of_a_guarded_agent_gets_from_the_loop_what_the_view_gives(
    tmp_path: Path,
) -> None:
    for guard in ({"token": True}, {"users": True}):
        bridge = _bridge(tmp_path, **guard)
        loop, view, keepalive = _both(bridge, _head("GET", "/readyz", "HTTP/1.1", ""))
        assert loop == (view, keepalive), guard
        assert b'"reason"' in view and b"state" in view
