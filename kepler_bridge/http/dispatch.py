"""A WSGI application for a fixed table of GET/HEAD routes: the request a route reads, the response
it returns, and the errors (404, 405, 500) as the routes' own JSON.

It replaces Flask, which with Werkzeug, Jinja and Click cost the worker 8 MiB of its 29 MiB PSS for
six routes. The answers are Flask's: the same status lines, headers in the same order, the same
texts; only a path with doubled slashes inside (`/v1//collect`) is a 404 where Werkzeug redirected.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable, Iterable, Mapping

# The logger, and the texts, of Flask and Werkzeug.
log = logging.getLogger("kepler_bridge")
NOT_FOUND = (
    "The requested URL was not found on the server. If you entered the URL manually please check"
    " your spelling and try again."
)
NOT_ALLOWED = "The method is not allowed for the requested URL."
INTERNAL_ERROR = (
    "The server encountered an internal error and was unable to complete your request. Either the"
    " server is overloaded or there is an error in the application."
)
METHODS = ("GET", "HEAD")


@dataclass(frozen=True)
class BasicAuth:
    """The user name and password of an `Authorization: Basic` header."""

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class Request:
    """One request as a route reads it: method, path and headers of its WSGI environ."""

    environ: Mapping[str, Any]

    @property
    def method(self) -> str:
        return self.environ.get("REQUEST_METHOD", "GET")

    @property
    def path(self) -> str:
        """The path, its leading slashes made one as Werkzeug did (`//metrics` is `/metrics`)."""
        return "/" + self.environ.get("PATH_INFO", "").lstrip("/")

    @property
    def remote_addr(self) -> str | None:
        return self.environ.get("REMOTE_ADDR")

    def header(self, name: str) -> str:
        """The header's value ("" when absent); repeated headers come joined by commas."""
        return self.environ.get("HTTP_" + name.upper().replace("-", "_"), "")

    def basic_auth(self) -> BasicAuth | None:
        """The basic-auth credentials, or None when there are none or they do not decode."""
        scheme, _, rest = self.header("Authorization").partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(rest.strip(" \t"), validate=True).decode()
        except (binascii.Error, UnicodeError):
            return None
        username, _, password = decoded.partition(":")
        return BasicAuth(username, password)


@dataclass
class Response:
    """A route's answer; `headers` follow Content-Type and Content-Length, in the order given."""

    body: bytes
    status: int = 200
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)

    def status_line(self) -> str:
        """As Werkzeug wrote it: "404 NOT FOUND"."""
        return f"{self.status} {HTTPStatus(self.status).phrase.upper()}"


def error(status: int, message: str) -> Response:
    """The JSON every error is answered with."""
    return Response(json.dumps({"error": message, "status": status}).encode(), status)


Route = Callable[[Request], Response]


class Routes:
    """The WSGI application: the route of the request's path answers GET and HEAD; HEAD gets the
    headers of GET without the body."""

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self.routes = dict(routes)
        # What the worker's WSGI bridge looks up besides the app (`wsgi.CACHED_ANSWERS`).
        self.extensions: dict[str, object] = {}

    def __call__(self, environ: Mapping[str, Any], start_response: Callable) -> Iterable[bytes]:
        request = Request(environ)
        response = self.answer(request)
        length = str(len(response.body))
        start_response(
            response.status_line(),
            [("Content-Type", response.content_type), ("Content-Length", length)]
            + response.headers,
        )
        return [] if request.method == "HEAD" else [response.body]

    def answer(self, request: Request) -> Response:
        """The route's response, or the error."""
        route = self.routes.get(request.path)
        if route is None:
            return error(404, NOT_FOUND)
        if request.method not in METHODS:
            refused = error(405, NOT_ALLOWED)
            refused.headers.append(("Allow", ", ".join(METHODS)))
            return refused
        try:
            return route(request)
        except Exception:  # one route's bug is a 500 and a log line, never a dead worker thread
            log.exception("Exception on %s [%s]", request.path, request.method)
            return error(500, INTERNAL_ERROR)
