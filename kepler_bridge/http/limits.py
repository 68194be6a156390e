"""What one connection may cost the worker, and how many it may hold.

Output: each accepted TCP socket gets a send buffer of its own (no autotuning towards `tcp_wmem`'s
maximum), grown to hold the connection's largest response whole, and a not-sent low-water mark of
one byte, so the kernel takes more of a response only once it has sent the last, and reports the
socket writable only then. Descriptors: the connection
cap is RLIMIT_NOFILE less the files the worker holds and room for those it opens later; when accept
still runs out of descriptors, accepting pauses and the failure is logged once per interval.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any

from kepler_bridge.log_limit import EveryInterval, Warns

# SO_SNDBUF asked for at first; Linux doubles it for its bookkeeping.
SEND_BUFFER_BYTES = 16 * 1024
# A response larger than the send buffer stalls at each buffer-full until the client's delayed ACK
# (40 ms on loopback): the buffer grows to hold a whole response, up to this (`wmem_max`'s default).
# What a client that never reads leaves queued stays bounded by the low-water mark: the bytes its
# receive window let through, and at most one segment more.
MAX_SEND_BUFFER_BYTES = 4 * 1024 * 1024
# The kernel takes more bytes, and polls writable, only when no byte of the last write is unsent.
NOTSENT_LOWAT_BYTES = 1
# Descriptors kept for the worker's own files besides those open when it starts serving: NVML
# device files, eBPF programs and maps, /proc and sysfs reads, the state file, kube connections,
# command pipes.
RESERVED_FILES = 128
MIN_CONNECTIONS = 16
# Errors of accept() that mean the process or the system is out of descriptors or memory.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_PAUSE_SECONDS = 0.5
ACCEPT_LOG_SECONDS = 60.0


@dataclass(frozen=True)
class ConnectionCap:
    """How many connections the worker holds at once, and what that was derived from."""

    connections: int
    nofile: int
    in_use: int

    @property
    def why(self) -> str:
        return (
            f"RLIMIT_NOFILE {self.nofile} at start less {self.in_use} descriptors then in use "
            f"and {RESERVED_FILES} kept for the agent's own files"
        )


def connection_cap(ceiling: int, log: Any) -> ConnectionCap:
    """The cap: `ceiling` (gunicorn's worker_connections) or less where RLIMIT_NOFILE is lower,
    which is logged."""
    soft = _nofile()
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # out of descriptors already
        in_use = soft
    if soft == resource.RLIM_INFINITY or soft - in_use - RESERVED_FILES >= ceiling:
        return ConnectionCap(ceiling, soft, in_use)
    cap = ConnectionCap(max(MIN_CONNECTIONS, soft - in_use - RESERVED_FILES), soft, in_use)
    log.info(
        "HTTP connections capped at %d: %s; raise RLIMIT_NOFILE to allow up to %d",
        cap.connections,
        cap.why,
        ceiling,
    )
    return cap


def client_waiting(listener: socket.socket) -> bool:
    """Whether a connection waits in the listener's backlog, left there."""
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    return bool(poller.poll(0))


def _nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def tune(sock: socket.socket) -> int:
    """Socket options of an accepted connection: no Nagle delay, bounded output; the send buffer
    asked for (0: none, not TCP)."""
    if sock.family == socket.AF_UNIX:
        return 0
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
    return SEND_BUFFER_BYTES


def fit_send_buffer(sock: socket.socket, size: int, asked: int) -> int:
    """Grow a TCP socket's send buffer, `asked` bytes so far, to hold a response of `size` bytes
    (the kernel's doubling leaves room for its bookkeeping); the size asked for now."""
    wanted = min(size, MAX_SEND_BUFFER_BYTES)
    if wanted <= asked or sock.family == socket.AF_UNIX:
        return asked
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wanted)
    return wanted


def abort(sock: socket.socket) -> None:
    """Make the next close a reset: the kernel drops what the client never read at once instead of
    keeping it queued behind a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already reset by the client


class AcceptFailures:
    """accept() failures for lack of descriptors: the first logged, then one line per interval."""

    def __init__(self, log: Warns, cap: ConnectionCap) -> None:
        self.cap = cap
        self.line = EveryInterval(
            log,
            "accept failed: %s; accepting pauses %.1f s each time and new connections wait. "
            "RLIMIT_NOFILE is %d and %d connections are open, the cap is %d (%s): raise "
            "RLIMIT_NOFILE (ulimit -n, LimitNOFILE=, the container runtime's nofile ulimit) or "
            "find what else holds descriptors",
            ACCEPT_LOG_SECONDS,
        )

    def failed(self, err: OSError, now: float, connections: int) -> float:
        """Note one failure with `connections` open; returns when accepting may resume."""
        self.line.warning(
            err, ACCEPT_PAUSE_SECONDS, _nofile(), connections, self.cap.connections, self.cap.why
        )
        return now + ACCEPT_PAUSE_SECONDS
