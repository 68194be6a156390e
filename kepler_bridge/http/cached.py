"""Answers the event loop gives itself, without a pool thread: GET and HEAD of /metrics,
/v1/collect and /healthz once the render cache holds their bytes, and of /readyz without
credentials.

Each route gives the status, headers and body its view in `app` gives, or None wherever the
answer is not certain without the view (bytes not rendered yet, basic auth, a wrong token, the
sampler stopped): the pool then runs the view. `tests/test_cached_answers.py` holds the two to the
same bytes.
"""

from __future__ import annotations

from typing import Callable

from kepler_bridge.http.app import OPENMETRICS_TYPE, TEXT_TYPE, RouteContext, ready_answer
from kepler_bridge.http.dispatch import Routes
from kepler_bridge.http.negotiation import bearer_matches, wants_gzip, wants_openmetrics
from kepler_bridge.http.wsgi import CACHED_ANSWERS, CachedAnswer

HEALTHY = b'{"status":"ok"}'
JSON_TYPE = "application/json"


class CachedRoutes:
    """The routes answered from the render cache, by WSGI environ."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx
        self.routes: dict[str, Callable[[dict], CachedAnswer | None]] = {
            "/metrics": self.metrics,
            "/v1/collect": self.collect,
            "/healthz": self.healthz,
            "/readyz": self.readyz,
        }

    def __call__(self, environ: dict) -> CachedAnswer | None:
        """The answer to the request of `environ`, or None where the view must give it."""
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD") or environ["SCRIPT_NAME"]:
            return None
        route = self.routes.get(environ["PATH_INFO"])
        return route(environ) if route is not None else None

    def metrics(self, environ: dict) -> CachedAnswer | None:
        """As `app.metrics`, where `app.refused` lets the request through without basic auth."""
        if not self._unguarded(environ):
            return None
        openmetrics = wants_openmetrics(environ.get("HTTP_ACCEPT", ""))
        gzipped = _wants_gzip(environ)
        variant = "openmetrics" if openmetrics else "text"
        body = self.ctx.cache.made(variant + "+gzip" if gzipped else variant)
        if body is None:
            return None
        content_type = OPENMETRICS_TYPE if openmetrics else TEXT_TYPE
        return _ok(content_type, body, gzipped, "Accept, Accept-Encoding")

    def collect(self, environ: dict) -> CachedAnswer | None:
        """As `app.collect` once a sample is rendered."""
        gzipped = _wants_gzip(environ)
        body = self.ctx.cache.made("baetyl+gzip" if gzipped else "baetyl")
        return None if body is None else _ok(JSON_TYPE, body, gzipped, "Accept-Encoding")

    def healthz(self, environ: dict) -> CachedAnswer | None:
        """As `app.healthz` while the sampler runs."""
        return _ok(JSON_TYPE, HEALTHY) if self.ctx.alive() else None

    def readyz(self, environ: dict) -> CachedAnswer | None:
        """As `app.readyz` for a request without credentials (a probe): no password check, so
        none waits behind checks that do."""
        if "HTTP_AUTHORIZATION" in environ:
            return None
        answer = ready_answer(self.ctx, errors=not self.ctx.settings().auth_token and self._open())
        headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body)))]
        return CachedAnswer(answer.status_line(), headers, answer.body)

    def _unguarded(self, environ: dict) -> bool:
        """Whether `app.refused` passes the request without a password check: nothing guards the
        data, or the request carries the bearer token."""
        token = self.ctx.settings().auth_token
        if token:
            return bearer_matches(environ.get("HTTP_AUTHORIZATION", ""), token)
        return self._open()

    def _open(self) -> bool:
        """Whether no basic-auth user guards the data."""
        return self.ctx.web is None or not self.ctx.web.current().users


def _wants_gzip(environ: dict) -> bool:
    return wants_gzip(environ.get("HTTP_ACCEPT_ENCODING", ""))


def _ok(content_type: str, body: bytes, gzipped: bool = False, vary: str = "") -> CachedAnswer:
    """A 200 with the headers `Routes` gives a `Response` of `body`, in its order."""
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    if gzipped:
        headers.append(("Content-Encoding", "gzip"))
    if vary:
        headers.append(("Vary", vary))
    return CachedAnswer("200 OK", headers, body)


def install(app: Routes, ctx: RouteContext) -> None:
    """Put the cached routes of `ctx` where the worker's WSGI bridge finds them."""
    app.extensions[CACHED_ANSWERS] = CachedRoutes(ctx)
