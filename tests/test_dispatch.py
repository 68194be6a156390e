"""The WSGI app the routes run on (`kepler_bridge/http/dispatch.py`): a route's exception, and the
basic-auth header as Werkzeug read it."""

from __future__ import annotations

import base64
import json
import logging
import wsgiref.util

import pytest

from kepler_bridge.http.dispatch import BasicAuth, Request, Response, Routes


def _call(app: Routes, path: str, method: str = "GET") -> tuple[str, list, bytes]:
    environ = {"PATH_INFO": path, "REQUEST_METHOD": method}
    wsgiref.util.setup_testing_defaults(environ)
    answered: list = []
    body = b"".join(app(environ, lambda status, headers: answered.extend((status, headers))))
    return answered[0], answered[1], body


def test_a_route_that_raises_is_a_json_500_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(request: Request) -> Response:
        raise ZeroDivisionError("division by zero")

    app = Routes({"/broken": broken, "/fine": lambda request: Response(b"{}")})
    with caplog.at_level(logging.ERROR):
        status, headers, body = _call(app, "/broken")
    assert status == "500 INTERNAL SERVER ERROR"
    assert headers == [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    assert json.loads(body)["status"] == 500 and "internal error" in json.loads(body)["error"]
    (record,) = caplog.records
    assert record.getMessage() == "Exception on /broken [GET]" and record.exc_info
    assert _call(app, "/fine")[0] == "200 OK"  # the next request is answered as ever


def _basic(value: str) -> BasicAuth | None:
    environ = {"HTTP_AUTHORIZATION": value}
    return Request(environ).basic_auth()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("Basic " + _b64(b"alice:pw:with:colons"), BasicAuth("alice", "pw:with:colons")),
        ("basic  " + _b64(b"alice:pw"), BasicAuth("alice", "pw")),
        ("Basic " + _b64(b"no-colon"), BasicAuth("no-colon", "")),
        ("Basic " + _b64("jürgen:ä".encode()), BasicAuth("jürgen", "ä")),
        ("Basic " + _b64(b"\xff:pw"), None),  # not UTF-8
        ("Basic !!!", None),
        ("Basic", BasicAuth("", "")),  # then checked as a user named "" (refused)
        ("Bearer " + _b64(b"alice:pw"), None),
        ("", None),
    ],
)
def test_basic_auth_reads_as_werkzeug_did(value: str, expected: BasicAuth | None) -> None:
    assert _basic(value) == expected
