"""What a request asks for: gzip, OpenMetrics, a bearer token (RFC 9110 §12.5, RFC 6750).

Names are case-insensitive and weighed by their q-values: a coding or type with q=0 is refused.
A scraper sends the same headers every time: the answers to the last few are kept."""

from __future__ import annotations

import hmac
from functools import lru_cache

OPENMETRICS = "application/openmetrics-text"


def _qualities(header: str) -> dict[str, float]:
    """Each name of a comma-separated list, lower-cased, with its highest q-value (1 unless
    given; an unreadable one counts as 0)."""
    found: dict[str, float] = {}
    for item in header.lower().split(","):
        name, *parameters = item.split(";")
        quality = 1.0
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip() == "q":
                try:
                    quality = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    quality = 0.0
        name = name.strip()
        found[name] = max(quality, found.get(name, 0.0))
    return found


@lru_cache(maxsize=64)
def wants_gzip(accept_encoding: str) -> bool:
    """Whether gzip is acceptable: named with q > 0, or else `*` with q > 0."""
    if "gzip" not in accept_encoding.lower() and "*" not in accept_encoding:
        return False
    qualities = _qualities(accept_encoding)
    quality = qualities.get("gzip", qualities.get("x-gzip"))
    return (qualities.get("*", 0.0) if quality is None else quality) > 0


@lru_cache(maxsize=64)
def wants_openmetrics(accept: str) -> bool:
    """Whether OpenMetrics is asked for with q > 0 and at least the text format's q (text/plain,
    else text/*, else */*)."""
    if OPENMETRICS not in accept.lower():
        return False
    qualities = _qualities(accept)
    text = qualities.get("text/plain", qualities.get("text/*", qualities.get("*/*", 0.0)))
    openmetrics = qualities.get(OPENMETRICS, 0.0)
    return openmetrics > 0 and openmetrics >= text


def bearer_matches(authorization: str, token: bytes) -> bool:
    """Whether an Authorization header carries the token: the scheme in any case, the token
    compared in constant time."""
    scheme, _, credentials = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token)
