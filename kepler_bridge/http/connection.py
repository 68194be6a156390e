"""One client connection as the event-loop worker sees it, and the waiting states it passes through.

A connection waits in one state at a time (for a request head, for its client to take a response,
for its client to close); each state has one fixed timeout, so its connections stay in deadline
order and the first is the one idle longest.
"""

from __future__ import annotations

import fcntl
import socket
import ssl
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

# ioctl(2) for the bytes of a TCP socket's send queue not yet sent (linux/sockios.h).
SIOCOUTQNSD = 0x894B


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

    def take_head(self) -> bytes | None:
        """The next complete request head, taken off the buffer; None while it is incomplete."""
        end = self.inbuf.find(b"\r\n\r\n", max(0, self.scanned - 3))
        if end < 0:
            self.scanned = len(self.inbuf)
            return None
        end += 4
        head, self.inbuf, self.scanned = bytes(self.inbuf[:end]), self.inbuf[end:], 0
        return head

    def send_pending(self) -> bool:
        """Hand the kernel what it takes of `out` without blocking; whether it took any byte.
        A broken connection raises OSError or ssl.SSLError."""
        progressed = False
        try:
            while self.out:
                if isinstance(self.sock, ssl.SSLSocket):
                    sent = self.sock.send(self.out[0])
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
