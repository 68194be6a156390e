"""One client connection as the event-loop worker sees it, and the waiting states it passes through.

A connection waits in one state at a time (for a request head, for its client to take a response,
for its client to close); each state has one fixed timeout, so its connections stay in deadline
order and the first is the one idle longest.
"""

from __future__ import annotations

import fcntl
import math
import re
import selectors
import socket
import ssl
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from kepler_bridge.http.webconfig import peer_allowed
from kepler_bridge.http.wsgi import Peer
from kepler_bridge.log_limit import EveryInterval

# ioctl(2) for the bytes of a TCP socket's send queue not yet sent (linux/sockios.h).
SIOCOUTQNSD = 0x894B
RECV_BYTES = 64 * 1024
# The most one TLS record holds. An SSL write of more, non-blocking, writes records until the socket
# is full and then raises SSLWantWriteError without saying how much it took: written a record at a
# time, each record the client takes counts as progress (the write timeout restarts).
TLS_RECORD_BYTES = 16 * 1024
# A head ends at an empty line. RFC 9112 2.2 lets a server take a bare LF for a line's end, as
# node_exporter (Go) and Python's http.server do; gunicorn's parser wants CRLF, so such a head is
# given it with each LF made CRLF. A bare CR stays what it was: gunicorn refuses it.
_HEAD_END = re.compile(rb"\n\r?\n")
_LINE_END = re.compile(rb"\r?\n")


def unmapped(address: tuple) -> tuple:
    """An IPv4 client of the dual-stack listener as IPv4 (::ffff:10.0.0.5 -> 10.0.0.5), so that
    logs and the routes name it as they would on an IPv4 listener."""
    host = address[0] if address else None
    if isinstance(host, str) and host.startswith("::ffff:") and "." in host:
        return host[7:], address[1]
    return address


@dataclass(eq=False)
class Conn:
    """One client connection: its socket, what it sent and what is still to send it."""

    sock: socket.socket
    client: tuple
    server: tuple
    handshaking: bool = False
    allowed_sans: tuple[str, ...] = ()
    inbuf: bytearray = field(default_factory=bytearray)
    scanned: int = 0
    out: list[memoryview] = field(default_factory=list)
    close_after_write: bool = False
    # SO_SNDBUF asked for (limits.fit_send_buffer).
    send_buffer: int = 0
    deadline: float = 0.0
    events: int = 0

    def __post_init__(self) -> None:
        self.client = unmapped(self.client)

    def peer(self) -> Peer:
        return Peer(self.client, self.server, isinstance(self.sock, ssl.SSLSocket))

    def handshake(self, log: Any, refused: EveryInterval) -> int | None:
        """Advance the TLS handshake: the selector events to wait for next (EVENT_READ for the
        first request once it is done), or None where the connection must close (`log` says why)."""
        sock = cast(ssl.SSLSocket, self.sock)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            return selectors.EVENT_READ
        except ssl.SSLWantWriteError:
            return selectors.EVENT_WRITE
        except (OSError, ssl.SSLError) as err:
            log.debug("TLS handshake with %s failed: %s", self.client, err)
            return None
        if not peer_allowed(sock, self.allowed_sans):
            refused.warning(self.client)
            return None
        self.handshaking = False
        return selectors.EVENT_READ

    def take_head(self) -> bytes | None:
        """The next complete request head, taken off the buffer, each line ending in CRLF; None
        while it is incomplete."""
        found = _HEAD_END.search(self.inbuf, max(0, self.scanned - 2))
        if found is None:
            self.scanned = len(self.inbuf)
            return None
        end = found.end()
        head, self.inbuf, self.scanned = bytes(self.inbuf[:end]), self.inbuf[end:], 0
        if head.count(b"\n") != head.count(b"\r\n"):
            head = _LINE_END.sub(b"\r\n", head)
        return head

    def receive(self) -> int | None:
        """Take what the client sent, without blocking: 0 when bytes came, the selector events to
        wait for when none did, None when the connection is over (closed, broken)."""
        while True:
            try:
                data = self.sock.recv(RECV_BYTES)
            except ssl.SSLWantWriteError:
                return selectors.EVENT_WRITE
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return selectors.EVENT_READ
            except (OSError, ssl.SSLError):
                return None
            if not data:
                return None
            self.inbuf += data
            if not isinstance(self.sock, ssl.SSLSocket) or not self.sock.pending():
                return 0

    def send_pending(self) -> bool:
        """Hand the kernel what it takes of `out` without blocking; whether it took any byte.
        A broken connection raises OSError or ssl.SSLError."""
        progressed = False
        try:
            while self.out:
                if isinstance(self.sock, ssl.SSLSocket):
                    sent = self.sock.send(self.out[0][:TLS_RECORD_BYTES])
                else:
                    sent = self.sock.sendmsg(self.out)
                progressed = progressed or sent > 0
                while sent and self.out:
                    first = self.out[0]
                    if sent >= len(first):
                        sent -= len(first)
                        self.out.pop(0)
                    else:
                        self.out[0] = first[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            pass
        return progressed

    def watch(self, selector: selectors.BaseSelector, events: int, handler: Callable) -> None:
        """Have `selector` call `handler` on `events` of the socket, instead of what it did."""
        if self.events:
            selector.modify(self.sock, events, handler)
        else:
            selector.register(self.sock, events, handler)
        self.events = events

    def unwatch(self, selector: selectors.BaseSelector) -> None:
        if self.events:
            selector.unregister(self.sock)
            self.events = 0

    def unsent(self) -> int:
        """Bytes the kernel holds for this connection and has not sent yet (0 where unknown)."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), SIOCOUTQNSD, bytes(4)))[0]
        except OSError:
            return 0


class Waiting(OrderedDict[Conn, None]):
    """The connections in one waiting state, oldest deadline first."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    def wait(self, conn: Conn, now: float) -> None:
        """(Re)start `conn`'s wait in this state: its deadline is `timeout` from `now`."""
        conn.deadline = now + self.timeout
        self[conn] = None
        self.move_to_end(conn)

    def idle_since(self) -> float:
        """When the connection idle longest in this state last made progress (it is not empty)."""
        return next(iter(self)).deadline - self.timeout


class States:
    """A worker's connections by what each waits for: a request head, its client to read the
    response, its client to close."""

    def __init__(self, header_timeout: float, write_timeout: float, linger: float) -> None:
        self.reading = Waiting(header_timeout)
        self.writing = Waiting(write_timeout)
        self.lingering = Waiting(linger)
        self.all = (self.reading, self.writing, self.lingering)

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self.all)

    def connections(self) -> list[Conn]:
        return [conn for waiting in self.all for conn in waiting]

    def forget(self, conn: Conn) -> None:
        """`conn` leaves whichever state it is in."""
        for waiting in self.all:
            waiting.pop(conn, None)

    def idle_longest(self) -> tuple[Conn, bool] | None:
        """The connection idle longest, and whether it waits for its client to read; None when no
        connection waits."""
        states = [waiting for waiting in self.all if waiting]
        if not states:
            return None
        waiting = min(states, key=Waiting.idle_since)
        return next(iter(waiting)), waiting is self.writing

    def next_deadline(self) -> float:
        """The earliest deadline of a waiting connection; infinity when none waits."""
        return min(
            (next(iter(waiting)).deadline for waiting in self.all if waiting), default=math.inf
        )

    def expired(self, now: float) -> list[tuple[Conn, bool]]:
        """The connections past their deadline, and whether each waits for its client to read."""
        found = []
        for waiting in self.all:
            for conn in waiting:
                if conn.deadline > now:
                    break
                found.append((conn, waiting is self.writing))
        return found
