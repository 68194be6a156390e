"""One HTTP(S) GET whose reply is bounded in bytes and whose whole exchange is bounded in time.

A per-read socket timeout alone lets a peer that sends one byte now and then hold the request
forever, so a timer cuts the connection at the deadline wherever the request stands (TLS
handshake, status line, headers or body).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

CHUNK_BYTES = 64 * 1024


class ReplyTooLarge(Exception):
    """The reply is longer than allowed; no more of it was read."""


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    body: bytearray  # empty unless the status is 2xx


def get(
    url: str,
    headers: Mapping[str, str],
    tls: ssl.SSLContext | None,
    timeout: float,
    max_bytes: int,
) -> Reply:
    """GET url, no proxy, no redirect. Raises TimeoutError when the whole exchange takes over
    `timeout` s, ReplyTooLarge past `max_bytes` of body, else OSError or HTTPException."""
    connection = _connection(url, tls, timeout)
    deadline = _Deadline(connection, timeout)
    try:
        connection.connect()
        deadline.connected()
        connection.request("GET", _target(url), headers=dict(headers))
        with connection.getresponse() as response:
            body = _body(response, max_bytes) if 200 <= response.status < 300 else bytearray()
    except (OSError, http.client.HTTPException):
        if deadline.passed.is_set():
            raise TimeoutError from None
        raise
    finally:
        deadline.cancel()
        connection.close()
    if deadline.passed.is_set():  # the cut ended the body early: this is not the whole reply
        raise TimeoutError
    return Reply(response.status, response.reason, body)


def _connection(url: str, tls: ssl.SSLContext | None, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "https":
        return http.client.HTTPSConnection(host, parts.port or 443, timeout=timeout, context=tls)
    return http.client.HTTPConnection(host, parts.port or 80, timeout=timeout)


def _target(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class _Deadline:
    """A timer that, at the deadline, shuts the connection's socket down: whatever read or
    handshake is blocked on it sees the end of the stream. (A host name's lookup, before there is
    a socket, is bounded by the resolver's own timeouts.)"""

    def __init__(self, connection: http.client.HTTPConnection, timeout: float) -> None:
        self.connection = connection
        # Kept once connected: getresponse() drops connection.sock when the reply ends with the
        # connection, while the body is still to be read from it.
        self.sock: socket.socket | None = None
        self.passed = threading.Event()
        self._lock = threading.Lock()  # once cancel() returns, no shutdown can reach a reused fd
        self._cancelled = False
        self._timer = threading.Timer(timeout, self._cut)
        self._timer.name, self._timer.daemon = "kepler-bridge-kube-deadline", True
        self._timer.start()

    def connected(self) -> None:
        self.sock = self.connection.sock
        if self.passed.is_set():  # connected just after the deadline: nothing was cut
            raise TimeoutError

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._timer.cancel()

    def _cut(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self.passed.set()
            sock = self.sock or self.connection.sock  # while connecting: the plain one under TLS
            if sock is not None:
                try:
                    # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would drop
                    # the TLS state the blocked thread is using.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:  # not connected yet
                    pass


def _body(response: http.client.HTTPResponse, max_bytes: int) -> bytearray:
    """The body, read in chunks; a declared or actual length over `max_bytes` stops reading."""
    if response.length is not None and response.length > max_bytes:
        raise ReplyTooLarge
    body = bytearray()
    while chunk := response.read1(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise ReplyTooLarge
    return body
