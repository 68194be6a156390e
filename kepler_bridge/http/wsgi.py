"""The event-loop worker's WSGI bridge: one buffered request head in, the response's bytes out.

It runs the app in the worker's pool threads. gunicorn parses the head and writes the response into
a `Collector` standing in for the socket; the worker's loop then sends those bytes without blocking.
Requests the app's cached answers cover (`CACHED_ANSWERS`) the loop answers itself, through the
same parser and response writer, without a thread hop: a sample in progress delays them only by the
GIL switches of the loop's own system calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from gunicorn import util
from gunicorn.http import RequestParser, wsgi
from gunicorn.http.errors import NoMoreData, ParseException
from gunicorn.workers.base import Worker

from kepler_bridge.log_limit import EveryInterval


class Collector:
    """Stands in for the client socket while the app runs: gunicorn writes the response into it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.chunks.append(bytes(data))

    def send(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def gettimeout(self) -> float:
        return 0.0  # "non-blocking": gunicorn's error writer then calls sendall directly


# gunicorn's Worker.handle_error(req, client, addr, exc): logs the error and writes its status.
ErrorWriter = Callable[[Any, Collector, tuple, Exception], None]


def quiet_client_errors(worker: Worker) -> ErrorWriter:
    """`worker.handle_error`, but for a request the client got wrong, whose log line would hold
    its bytes (a token perhaps) and which any client can send in a loop: one line at most a
    minute, its kind and address only."""
    limited = EveryInterval(worker.log, "bad request from %s: %s (its text is not logged)")
    log = worker.log
    silent = SimpleNamespace(warning=lambda *_: None, access=log.access, debug=log.debug)
    quiet = SimpleNamespace(cfg=worker.cfg, log=silent)

    def write(req: Any, client: Collector, addr: tuple, exc: Exception) -> None:
        if not isinstance(exc, ParseException):
            return worker.handle_error(req, client, addr, exc)
        limited.warning(addr[0] if addr else "", type(exc).__name__)
        return Worker.handle_error(quiet, req, client, addr, exc)  # gunicorn's answer

    return write


# Where a WSGI app's `extensions` hold its cached answers (`http.cached`).
CACHED_ANSWERS = "kepler_bridge.cached_answers"


@dataclass(frozen=True)
class CachedAnswer:
    """A response the app gives from bytes made already: status, headers (as the app would send
    them) and body."""

    status: str
    headers: list[tuple[str, str]]
    body: bytes


# WSGI environ -> the app's answer to it, or None where the app itself must answer.
CachedAnswers = Callable[[dict], CachedAnswer | None]


def cached_answers(app: Any) -> CachedAnswers | None:
    """The cached answers the WSGI `app` offers, if any."""
    return getattr(app, "extensions", {}).get(CACHED_ANSWERS)


@dataclass(frozen=True)
class Peer:
    """The two ends of one connection, and whether it speaks TLS."""

    client: tuple
    server: tuple
    https: bool


@dataclass(frozen=True)
class WsgiBridge:
    """Runs the WSGI `app` on request heads with gunicorn's parser (limits from `cfg`) and writer.

    `alive` turns False when the worker stops: every answer from then on closes its connection.
    """

    app: Callable
    cfg: Any
    write_error: ErrorWriter
    alive: Callable[[], bool]
    cached: CachedAnswers | None = None

    @classmethod
    def of(cls, worker: Worker) -> WsgiBridge:
        """The bridge of a gunicorn worker's app, alive while the worker is; its errors written
        as `quiet_client_errors` writes them."""
        alive = lambda: worker.alive  # noqa: E731
        return cls(
            worker.wsgi, worker.cfg, quiet_client_errors(worker), alive, cached_answers(worker.wsgi)
        )

    def answer(self, head: bytes, peer: Peer) -> tuple[list[bytes], bool]:
        """The response's bytes, and whether the connection may carry another request."""
        collector = Collector()
        req = None
        try:
            req = next(RequestParser(self.cfg, [head], peer.client))
            keepalive = self._run(req, collector, peer)
        except (StopIteration, NoMoreData):
            return [], False  # a head with no request line in it: nothing to answer
        except Exception as err:  # a bad request line or header, or an app error: gunicorn answers
            collector.chunks.clear()
            self.write_error(req, collector, peer.client, err)
            return collector.chunks, False
        return collector.chunks, keepalive

    def answer_cached(self, head: bytes, peer: Peer) -> tuple[list[bytes], bool] | None:
        """As `answer`, from the app's cached answers; None where the app must run (in the pool)."""
        if self.cached is None:
            return None
        collector = Collector()
        try:
            resp, environ = self._start(
                next(RequestParser(self.cfg, [head], peer.client)), collector, peer
            )
        except Exception:  # no request, or a bad one: `answer` gives gunicorn's own response
            return None
        found = self.cached(environ)
        if found is None:
            return None
        resp.start_response(found.status, found.headers)
        resp.send_headers()
        if environ["REQUEST_METHOD"] != "HEAD":
            collector.chunks.append(found.body)
        return collector.chunks, not resp.should_close()

    def _start(self, req: Any, collector: Collector, peer: Peer) -> tuple[Any, dict]:
        """gunicorn's response writer and WSGI environ for `req`."""
        resp, environ = wsgi.create(req, collector, peer.client, peer.server, self.cfg)
        environ["wsgi.multithread"] = True
        if peer.https:
            environ["wsgi.url_scheme"] = "https"
        if _has_body(req) or not self.alive():
            # Bodies are never read (every endpoint is GET or HEAD): the connection is not reused.
            resp.force_close()
        return resp, environ

    def _run(self, req: Any, collector: Collector, peer: Peer) -> bool:
        resp, environ = self._start(req, collector, peer)
        respiter = self.app(environ, resp.start_response)
        try:
            for item in respiter:
                resp.write(item)
            resp.close()
        finally:
            if hasattr(respiter, "close"):
                respiter.close()
        return not resp.should_close()


def _has_body(req: Any) -> bool:
    return any(
        name == "TRANSFER-ENCODING" or (name == "CONTENT-LENGTH" and value.strip() != "0")
        for name, value in req.headers
    )


def error_response(status: int, reason: str, message: str) -> bytes:
    """A complete error response, as gunicorn writes one, for the loop to send itself."""
    collector = Collector()
    util.write_error(collector, status, reason, message)
    return b"".join(collector.chunks)
