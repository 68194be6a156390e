"""The routes and their guards over the render cache, served by `dispatch.Routes`; a request never
touches a driver."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from kepler_bridge.config import Config
from kepler_bridge.exposition import RenderCache, RenderSettings, baetyl
from kepler_bridge.exposition.history import render as render_history
from kepler_bridge.http import live_page
from kepler_bridge.http.dispatch import Request, Response, Routes, error
from kepler_bridge.http.negotiation import bearer_matches, wants_gzip, wants_openmetrics
from kepler_bridge.http.passwords import PasswordCheck
from kepler_bridge.http.webconfig import WebConfigFile
from kepler_bridge.model import Snapshot
from kepler_bridge.store import SnapshotStore

TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
READY_AGE_INTERVALS = 3


@dataclass(frozen=True)
class WebSettings:
    """What the HTTP layer needs: the node name and interval, the bearer token and the render
    settings."""

    node_name: str
    interval: float
    render: RenderSettings
    auth_token: bytes = field(repr=False)

    @classmethod
    def of(cls, config: Config) -> WebSettings:
        """The web settings within the agent's settings."""
        return cls(config.node_name, config.interval, RenderSettings.of(config), config.auth_token)


def _encoded(response: Response, gzipped: bool, vary: str) -> Response:
    """Mark a cached rendering's encoding and what it varies by."""
    if gzipped:
        response.headers.append(("Content-Encoding", "gzip"))
    response.headers.append(("Vary", vary))
    return response


def _wants_gzip(request: Request) -> bool:
    return wants_gzip(request.header("Accept-Encoding"))


def readiness(snapshot: Snapshot | None, now: float, errors: bool) -> tuple[bool, str]:
    """Ready when a snapshot younger than 3 intervals exists and at least one source is up; the
    reason names each source's error, or with `errors` False only its state."""
    if snapshot is None:
        return False, "no sample has completed yet"
    age = now - snapshot.timestamp
    if age > READY_AGE_INTERVALS * snapshot.interval_seconds:
        return False, f"newest sample is {age:.1f}s old (more than {READY_AGE_INTERVALS} intervals)"
    if not any(status.up for status in snapshot.sources):
        reasons = (
            "; ".join(
                f"{s.name}: {(s.error if errors else '') or s.state}" for s in snapshot.sources
            )
            or "no source configured"
        )
        return False, f"no source is up ({reasons})"
    return True, "ok"


@dataclass(frozen=True)
class RouteContext:
    """What the routes answer from: the store and its render cache, the settings in force, whether
    the sampler runs, the web config (basic-auth users) and the password check."""

    store: SnapshotStore
    cache: RenderCache
    settings: Callable[[], WebSettings]
    alive: Callable[[], bool]
    web: WebConfigFile | None
    passwords: PasswordCheck


def refused(ctx: RouteContext, request: Request) -> Response | None:
    """None where the request may read guarded data (the bearer token or a basic-auth user), else
    the answer."""
    token = ctx.settings().auth_token
    users = ctx.web.current().users if ctx.web is not None else {}
    if not token and not users:
        return None
    if token and bearer_matches(request.header("Authorization"), token):
        return None
    if not users:
        response = error(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>'")
        response.headers.append(("WWW-Authenticate", 'Bearer realm="kepler-bridge"'))
        return response
    credentials = request.basic_auth()
    if credentials is not None:
        password = credentials.password.encode()
        valid = ctx.passwords.check(users, credentials.username, password, request.remote_addr)
        if valid is None:
            busy = error(503, "too many password checks at once; retry in a second")
            busy.headers.append(("Retry-After", "1"))
            return busy
        if valid:
            return None
    response = error(
        401,
        "missing or wrong user name or password; send HTTP basic auth"
        + (" or 'Authorization: Bearer <token>'" if token else ""),
    )
    response.headers.append(("WWW-Authenticate", 'Basic realm="kepler-bridge", charset="UTF-8"'))
    return response


def metrics(ctx: RouteContext, request: Request) -> Response:
    """/metrics: Prometheus text, or OpenMetrics when the scraper accepts it."""
    if denied := refused(ctx, request):
        return denied
    openmetrics = wants_openmetrics(request.header("Accept"))
    variant = "openmetrics" if openmetrics else "text"
    gzipped = _wants_gzip(request)
    found = ctx.cache.get(variant + "+gzip" if gzipped else variant)
    if found is None:
        return error(503, "no sample has completed yet; retry in one interval")
    content_type = OPENMETRICS_TYPE if openmetrics else TEXT_TYPE
    response = Response(found[1], content_type=content_type)
    return _encoded(response, gzipped, "Accept, Accept-Encoding")


def collect(ctx: RouteContext, request: Request) -> Response:
    """/v1/collect: the baetyl JSON, with no devices before the first sample."""
    gzipped = _wants_gzip(request)
    found = ctx.cache.get("baetyl+gzip" if gzipped else "baetyl")
    if found is None:
        now = ctx.settings()
        empty = Snapshot(
            node=now.node_name, timestamp=0.0, duration_seconds=0.0, interval_seconds=now.interval
        )
        return Response(baetyl.render(empty, now.render.memory_unit))
    return _encoded(Response(found[1]), gzipped, "Accept-Encoding")


def healthz(ctx: RouteContext, request: Request) -> Response:
    """/healthz: 200 while the sampling thread runs."""
    if not ctx.alive():
        return error(503, "the sampling thread has stopped; restart the agent")
    return Response(b'{"status":"ok"}')


def readyz(ctx: RouteContext, request: Request) -> Response:
    """/readyz: `readiness` of the newest snapshot, with each source's state; the sources' error
    texts only to a request that may read guarded data (the probes send no credentials)."""
    return ready_answer(ctx, errors=refused(ctx, request) is None)


def ready_answer(ctx: RouteContext, errors: bool) -> Response:
    """`readyz`'s answer, with the sources' error texts or without."""
    snapshot = ctx.store.latest()
    ready, reason = readiness(snapshot, time.time(), errors)
    sources = {
        s.name: {"state": s.state, "reason": s.error} if errors else {"state": s.state}
        for s in (snapshot.sources if snapshot else ())
    }
    return Response(
        json.dumps({"ready": ready, "reason": reason, "sources": sources}).encode(),
        200 if ready else 503,
    )


def index(ctx: RouteContext, request: Request) -> Response:
    """/: the live page, filled in with the newest snapshot for a first paint."""
    if denied := refused(ctx, request):
        return denied
    now = ctx.settings()
    page = live_page.page(now.node_name, now.interval, ctx.store.latest())
    response = Response(page, content_type="text/html; charset=utf-8")
    response.headers.append(("Content-Security-Policy", live_page.CONTENT_SECURITY_POLICY))
    response.headers.append(("X-Content-Type-Options", "nosniff"))
    return response


def history(ctx: RouteContext, request: Request) -> Response:
    """/api/v1/history: the live page's chart data."""
    if denied := refused(ctx, request):
        return denied
    gzipped = _wants_gzip(request)
    found = ctx.cache.get("history+gzip" if gzipped else "history")
    if found is None:
        return error(503, "no sample has completed yet; retry in one interval")
    response = _encoded(Response(found[1]), gzipped, "Accept-Encoding")
    response.headers.append(("X-Content-Type-Options", "nosniff"))
    return response


# Every route; each answers GET and HEAD only (`dispatch.Routes`).
ROUTES: dict[str, Callable[[RouteContext, Request], Response]] = {
    "/metrics": metrics,
    "/v1/collect": collect,
    "/healthz": healthz,
    "/readyz": readyz,
    "/": index,
    "/api/v1/history": history,
}


def create_app(
    store: SnapshotStore,
    settings: Callable[[], WebSettings],
    alive: Callable[[], bool] = lambda: True,
    web: WebConfigFile | None = None,
) -> Routes:
    """The WSGI application serving `ROUTES`; `settings` gives the settings in force (they change
    on reload). No route serves files: the page is served filled in, and guarded."""
    cache = RenderCache(
        store,
        lambda: settings().render,
        {"history": lambda snap, _: render_history(store.history, snap)},
    )
    ctx = RouteContext(store, cache, settings, alive, web, PasswordCheck())
    routes = Routes({path: partial(view, ctx) for path, view in ROUTES.items()})
    from kepler_bridge.http.cached import install  # it imports this module

    install(routes, ctx)
    return routes
