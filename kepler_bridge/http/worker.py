"""gunicorn worker: one event loop reads requests and writes responses; threads only run the routes.

A slow or silent client costs a socket and a few bytes, never a thread: a request reaches the thread
pool only once its whole head is buffered, and its response is written back by the loop, without
blocking. A request whose answer the render cache holds already the loop answers itself (`cached`),
so a sample in progress delays it by a GIL switch at most. A head not complete within
`http_header_timeout`, or a response left unread for `http_write_timeout`, closes the connection. A
connection's next request is parsed only once the kernel has sent the whole of its last response
(`limits`): a client that never reads gets one.
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import socket
import ssl
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

from gunicorn import util
from gunicorn.workers.base import Worker

from kepler_bridge.http.connection import RECV_BYTES, Conn, States
from kepler_bridge.http.host import WorkerHost
from kepler_bridge.http.limits import (
    OUT_OF_RESOURCES,
    AcceptFailures,
    ConnectionCap,
    abort,
    client_waiting,
    connection_cap,
    fit_send_buffer,
    tune,
)
from kepler_bridge.http.wsgi import WsgiBridge, error_response
from kepler_bridge.log_limit import EveryInterval
from kepler_bridge.turns import TURNS

# A head larger than this is refused with 431 (gunicorn's own line and field limits apply below it).
MAX_HEAD_BYTES = 64 * 1024
# How often the worker tells the master it lives (the master waits 60 s) and checks its parent
# does; else an idle worker sleeps until its next deadline or event (a wake-up costs ~0.2 ms of
# CPU). The master's death ends it at once where the kernel allows (server.end_with_master).
HEARTBEAT_SECONDS = 10.0
# After "Connection: close", unread client bytes are drained this long so the close sends no RST.
LINGER_SECONDS = 2.0
ACCEPTS_PER_EVENT = 64
# How long a thread holds the GIL while another waits for it (CPython's default: 5 ms). The loop
# waits for it after each system call while the sampler runs: shorter, a scrape then waits less.
GIL_SWITCH_SECONDS = 0.0002
REFUSED_CLIENT = "TLS client %s refused: no certificate naming one of client_allowed_sans"


class EventLoopWorker(Worker):
    """One selector loop: accept, TLS handshake, request heads, responses, cached answers; a pool
    runs the routes."""

    # Made in init_process, after the fork.
    selector: selectors.EpollSelector
    pool: ThreadPoolExecutor
    bridge: WsgiBridge
    # Made in run(), once the agent's own files are open.
    cap: ConnectionCap
    failures: AcceptFailures
    not_allowed: EveryInterval

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host: WorkerHost = self.app
        self.settings = self.host.connections
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.states = States(
            self.settings.header_timeout, self.settings.write_timeout, LINGER_SECONDS
        )
        self.reading, self.writing, self.lingering = self.states.all
        self.ready: deque[Conn] = deque()  # next request buffered while the last answer was sent
        self.busy, self.accepting = 0, False
        self.hup = False  # a SIGHUP the loop has to pass on
        self.resume_at = 0.0  # while accepting pauses for lack of descriptors: when it resumes
        self.stop_by = float("inf")

    def init_process(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        self.selector = selectors.EpollSelector()
        self.pool = ThreadPoolExecutor(max_workers=self.cfg.threads, thread_name_prefix="http")
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.bridge = WsgiBridge.of(self)

    def handle_exit(self, sig, frame) -> None:
        self.alive = False

    def init_signals(self) -> None:
        super().init_signals()
        signal.signal(signal.SIGHUP, self.handle_hup)
        signal.siginterrupt(signal.SIGHUP, False)

    def handle_hup(self, sig, frame) -> None:
        """SIGHUP from the master: noted; the loop passes it on, as that may take a lock."""
        self.hup = True

    def run(self) -> None:
        # The base class routes signals to PIPE[1] too: signals and finished requests wake select().
        self.selector.register(self.PIPE[0], selectors.EVENT_READ, partial(self._wake))
        self.cap = connection_cap(self.cfg.worker_connections, self.log)
        self.failures = AcceptFailures(self.log, self.cap)
        self.not_allowed = EveryInterval(self.log, REFUSED_CLIENT)
        self._set_accepting(True)
        TURNS.watch(self.selector.fileno())
        next_beat = 0.0
        while self.alive or ((self.busy or self.writing) and time.monotonic() < self.stop_by):
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + HEARTBEAT_SECONDS
            self._tick(now)
            wake = min(
                next_beat, self.states.next_deadline(), self.resume_at or next_beat, self.stop_by
            )
            events = self.selector.select(0 if self.ready else max(wake - now, 0.0))
            if events or self.ready:
                TURNS.serving()
            for key, _mask in events:
                self._call(key.data)
            for _ in range(len(self.ready)):  # each one request, then the others' events
                conn = self.ready.popleft()
                if conn in self.reading:
                    self._call(partial(self._read_buffered, conn))
            TURNS.served()
        self.pool.shutdown(wait=False)
        for conn in self.states.connections():
            self._close(conn)

    def _beat(self) -> None:
        """Tell the master this worker lives; stop when the master is gone."""
        self.notify()
        if self.ppid != os.getppid():
            self.log.info("parent changed, shutting down: %s", self)
            self.alive = False

    def _tick(self, now: float) -> None:
        """Timeouts, the end of an accept pause, a SIGHUP and noticing a stop: at every wake-up."""
        self._expire(now)
        if self.hup:
            self.hup = False
            self.host.reload()
        if not self.alive and self.stop_by == float("inf"):
            self._stop_reading(now)
        elif self.alive and self.resume_at and now >= self.resume_at:
            self._set_accepting(True)

    def _call(self, callback: partial) -> None:
        """Run one event's handler; a failure closes that connection only, never the worker."""
        try:
            callback()
        except Exception:
            self.log.exception("HTTP event handler %s failed", callback.func.__name__)
            conn = callback.args[0] if callback.args else None
            if isinstance(conn, Conn):
                self._close(conn)

    def _set_accepting(self, enabled: bool) -> None:
        self.resume_at = 0.0
        if enabled == self.accepting:
            return
        for listener in self.sockets:
            if enabled:
                listener.setblocking(False)
                handler = partial(self._accept, listener)
                self.selector.register(listener, selectors.EVENT_READ, handler)
            else:
                self.selector.unregister(listener)
        self.accepting = enabled

    def _open_connections(self) -> int:
        return len(self.states) + self.busy

    def _accept(self, listener: socket.socket) -> None:
        fresh: set[Conn] = set()  # accepted in this call: never evicted for the next
        for _ in range(ACCEPTS_PER_EVENT):
            if self._open_connections() >= self.cap.connections:
                if not client_waiting(listener):
                    return  # at the cap with no client waiting: nobody to make room for
                if not self._make_room(fresh):
                    self._set_accepting(False)  # back when a connection closes
                    return
            try:
                sock, client = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while it waited in the backlog
            except OSError as err:
                if err.errno not in OUT_OF_RESOURCES:
                    raise
                # The listener stays readable: leave the selector for a pause, not spin on it.
                self._set_accepting(False)
                now = time.monotonic()
                self.resume_at = self.failures.failed(err, now, self._open_connections())
                return
            fresh.add(self._admit(sock, client, listener.getsockname()))

    def _make_room(self, fresh: set[Conn]) -> bool:
        """At the cap, a client waiting: close the connection idle longest, whether it waits for a
        request head or for its client to read; False when every connection but those just
        accepted (`fresh`) is running a request."""
        idle = self.states.idle_longest()
        if idle is None or idle[0] in fresh:
            return False
        self._close(idle[0], reset=idle[1])
        return True

    def _admit(self, sock: socket.socket, client: tuple, server: tuple) -> Conn:
        sock.setblocking(False)
        conn = Conn(sock, client, server, send_buffer=tune(sock))
        tls = self.settings.tls.current() if self.settings.tls is not None else None
        if self.settings.web is not None:
            web = self.settings.web.current()
            conn.allowed_sans = web.allowed_sans
            if web.tls is not None:  # else --tls-cert's pair, if any: a file of users only
                tls = web.tls
        if tls is not None:
            conn.sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn.handshaking = True
        self._start_reading(conn)
        return conn

    # Reading a request head --------------------------------------------------------------------

    def _start_reading(self, conn: Conn) -> None:
        self.reading.wait(conn, time.monotonic())
        if conn.inbuf:
            # Pipelined: taken in the loop, not in this answer's call chain; meanwhile no event of
            # the answer just sent (its write watch) may call back for the next.
            conn.unwatch(self.selector)
            self.ready.append(conn)
        else:
            self._watch(conn, selectors.EVENT_READ, self._on_readable)

    def _read_buffered(self, conn: Conn) -> None:
        if not self._dispatch_if_complete(conn):
            self._watch(conn, selectors.EVENT_READ, self._on_readable)

    def _on_readable(self, conn: Conn) -> None:
        if conn.handshaking:
            self._handshake(conn)
            return
        events = conn.receive()
        if events is None:
            self._close(conn)
        elif not events:
            self._read_buffered(conn)  # and back to waiting for reads if the head is not whole
        elif events != conn.events:
            self._watch(conn, events, self._on_readable)

    def _handshake(self, conn: Conn) -> None:
        events = conn.handshake(self.log, self.not_allowed)
        if events is None:
            self._close(conn)
        else:
            self._watch(conn, events, self._on_readable)

    def _dispatch_if_complete(self, conn: Conn) -> bool:
        """Answer a buffered, complete request head from the app's cached answers, else hand it to
        the pool; True when the connection left `reading`."""
        head = conn.take_head()
        if head is None:
            if len(conn.inbuf) > MAX_HEAD_BYTES:
                answer = error_response(
                    431,
                    "Request Header Fields Too Large",
                    f"request head over {MAX_HEAD_BYTES} bytes",
                )
                self._respond(conn, [answer], close=True)
                return True
            return False
        cached = self.bridge.answer_cached(head, conn.peer())
        if cached is not None:
            self._respond(conn, cached[0], close=not (cached[1] and self.alive))
            return True
        del self.reading[conn]
        conn.unwatch(self.selector)
        self.busy += 1
        self.pool.submit(self._serve, conn, head)
        return True

    # Running the app (pool threads) ---------------------------------------------------------------

    def _serve(self, conn: Conn, head: bytes) -> None:
        chunks, keepalive = self.bridge.answer(head, conn.peer())
        self.done.put((conn, chunks, keepalive))
        try:
            os.write(self.PIPE[1], b".")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already; the loop drains `done` on the next one

    def _wake(self) -> None:
        try:
            os.read(self.PIPE[0], 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                conn, chunks, keepalive = self.done.get_nowait()
            except queue.Empty:
                return
            self.busy -= 1
            self._respond(conn, chunks, close=not (keepalive and self.alive))

    # Writing the response -------------------------------------------------------------------------

    def _respond(self, conn: Conn, chunks: list[bytes], close: bool) -> None:
        self.reading.pop(conn, None)
        if isinstance(conn.sock, ssl.SSLSocket):
            chunks = [b"".join(chunks)]  # one TLS write: no small record left behind for Nagle
        conn.send_buffer = fit_send_buffer(conn.sock, sum(map(len, chunks)), conn.send_buffer)
        conn.out = [memoryview(chunk) for chunk in chunks if chunk]
        conn.close_after_write = close
        self.writing.wait(conn, time.monotonic())
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        if not conn.out:
            # Writable again with all handed over: the kernel has sent every byte (limits).
            self._sent(conn)
            return
        try:
            progressed = conn.send_pending()
        except (OSError, ssl.SSLError):
            self._close(conn)
            return
        if progressed:
            # The kernel takes bytes only once it has sent the last ones: the client is reading.
            self.writing.wait(conn, time.monotonic())
        if not conn.out and not conn.unsent():
            self._sent(conn)
        else:
            self._watch(conn, selectors.EVENT_WRITE, self._flush)

    def _sent(self, conn: Conn) -> None:
        del self.writing[conn]
        if conn.close_after_write:
            self._linger(conn)
        else:
            self._start_reading(conn)

    def _linger(self, conn: Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self.lingering.wait(conn, time.monotonic())
        self._watch(conn, selectors.EVENT_READ, self._on_lingering)

    def _on_lingering(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return
        except (OSError, ssl.SSLError):
            data = b""
        if not data:
            self._close(conn)

    # Bookkeeping ----------------------------------------------------------------------------------

    def _watch(self, conn: Conn, events: int, handler: Callable[[Conn], None]) -> None:
        conn.watch(self.selector, events, partial(handler, conn))

    def _close(self, conn: Conn, reset: bool = False) -> None:
        """`reset`: the client is not reading what is queued for it, so drop that at once."""
        if reset:
            abort(conn.sock)
        conn.unwatch(self.selector)
        self.states.forget(conn)
        util.close(conn.sock)
        if self.alive and not self.accepting:
            self._set_accepting(True)

    def _expire(self, now: float) -> None:
        for conn, reset in self.states.expired(now):
            self._close(conn, reset=reset)

    def _stop_reading(self, now: float) -> None:
        """On shutdown: no new connections; idle ones close, answers in progress get a quarter of
        the master's grace (the rest is the sampler's and the detectors' stop, `host.stop`)."""
        self.stop_by = now + self.cfg.graceful_timeout / 4
        self._set_accepting(False)
        for conn in list(self.reading):
            self._close(conn)
