"""Slow, silent and non-reading HTTP clients against a loopback port, bounded in count and time."""

from __future__ import annotations

import select
import socket
import threading
import time

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: drip\r\nAccept: */*\r\n\r\n"


def _connect(port: int, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf
        )  # before connect: sets the window
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (EOF or reset), reading what it sent."""
    while True:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        try:
            if not sock.recv(1 << 20):
                return True
        except OSError:
            return True


def send_queue_bytes(port: int) -> int:
    """Bytes the kernel holds in the send queues of the server's side of `port`'s TCP connections
    (tx_queue of /proc/net/tcp and tcp6), including closed ones the kernel still has to send."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as file:
            next(file)
            for line in file:
                fields = line.split()
                listening = fields[3] == "0A"
                if not listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    total += int(fields[4].split(":")[0], 16)
    return total


def hung_up(sock: socket.socket) -> bool:
    """Whether the server closed this connection, without reading what it sent."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


class Attack:
    """Slowloris and non-reading clients held open on a port until stop() or `max_seconds`."""

    def __init__(
        self,
        port: int,
        silent: int = 0,
        dripping: int = 0,
        non_readers: int = 0,
        drip_every: float = 0.5,
        pipelined: int = 200,
        max_seconds: float = 120.0,
        reconnect: bool = False,
    ) -> None:
        self.port = port
        self.reconnect = reconnect
        self.reconnects = 0
        self.silent = [_connect(port) for _ in range(silent)]
        self.dripping = [_connect(port) for _ in range(dripping)]
        self.non_readers = [_connect(port, rcvbuf=4096) for _ in range(non_readers)]
        self.drip_every = drip_every
        self.pipelined = pipelined
        self.deadline = time.monotonic() + max_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Attack":
        for sock in self.silent:
            self._start_silent(sock)
        for sock in self.non_readers:
            self._start_non_reader(sock)
        self._thread.start()
        return self

    @staticmethod
    def _start_silent(sock: socket.socket) -> None:
        sock.sendall(b"G")  # one byte of a request, then nothing

    def _start_non_reader(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            sock.send(REQUEST * self.pipelined)  # as much as the socket takes; never read
        except BlockingIOError:
            pass

    def _replace_closed(self) -> None:
        """Open a new connection for each one the server closed, as a real attacker would."""
        for group, start, rcvbuf in (
            (self.silent, self._start_silent, 0),
            (self.dripping, None, 0),
            (self.non_readers, self._start_non_reader, 4096),
        ):
            for index, sock in enumerate(group):
                if not hung_up(sock):
                    continue
                sock.close()
                group[index] = _connect(self.port, rcvbuf)
                if start:
                    start(group[index])
                self.reconnects += 1

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        position = 0
        while not self._stop.wait(self.drip_every) and time.monotonic() < self.deadline:
            byte = REQUEST[position % (len(REQUEST) - 4) :][:1]  # never completes the head
            position += 1
            for sock in self.dripping:
                try:
                    sock.send(byte)
                except OSError:
                    pass  # closed by the server: the point of the exercise
            if self.reconnect:
                self._replace_closed()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for sock in self.silent + self.dripping + self.non_readers:
            sock.close()
