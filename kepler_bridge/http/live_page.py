"""The live page at `/`: one HTML file whose script charts `/api/v1/history`; its first paint is
filled in here."""

from __future__ import annotations

import base64
import hashlib
import html
import re
from importlib import resources

from kepler_bridge import __version__
from kepler_bridge.model import Snapshot

_TEMPLATE = resources.files("kepler_bridge.http").joinpath("static/index.html").read_text("utf-8")


def _csp(template: str) -> str:
    """Allows exactly the page's own inline script and style (by hash) and requests to this
    agent."""
    hashes = {
        kind: f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for kind, body in re.findall(r"<(script|style)>(.*?)</\1>", template, re.DOTALL)
    }
    return (
        f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


CONTENT_SECURITY_POLICY = _csp(_TEMPLATE)


def page(node_name: str, interval: float, snapshot: Snapshot | None) -> bytes:
    """The page, with node, version and source status filled in for a first paint; its script
    does the rest."""
    rows = "".join(
        f"<tr><td>{html.escape(s.name)}</td><td class='{s.state}'>{s.state}</td>"
        f"<td>{html.escape(s.error)}</td></tr>"
        for s in (snapshot.sources if snapshot else ())
    )
    values = {
        "NODE": html.escape(node_name),
        "VERSION": html.escape(__version__),
        "INTERVAL": f"{interval:g}",
        "SOURCES": rows,
    }
    return re.sub(r"@([A-Z]+)@", lambda match: values[match[1]], _TEMPLATE).encode()
