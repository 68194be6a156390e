"""Content negotiation and the bearer scheme, as RFC 9110 and RFC 6750 read them."""

from __future__ import annotations

import pytest

from kepler_bridge.http.negotiation import bearer_matches, wants_gzip, wants_openmetrics

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize(
    ("header", "gzip"),
    [
        ("gzip", True),
        ("GZIP", True),
        ("deflate, gzip;q=0.5", True),
        ("*", True),
        ("", False),
        ("identity", False),
        ("gzip;q=0", False),
        ("identity, gzip;q=0", False),
        ("gzip;q=0, *", False),
        ("*;q=0", False),
        ("gzip;q=oops", False),
        ("x-gzip", True),
    ],
)
def test_gzip_is_sent_only_where_its_q_value_allows(header: str, gzip: bool) -> None:
    assert wants_gzip(header) is gzip


@pytest.mark.parametrize(
    ("header", "openmetrics"),
    [
        (PROMETHEUS_ACCEPT, True),
        ("application/openmetrics-text", True),
        ("APPLICATION/OPENMETRICS-TEXT; version=1.0.0", True),
        ("text/plain;version=0.0.4", False),
        ("*/*", False),
        ("", False),
        ("application/openmetrics-text;q=0, text/plain;version=0.0.4", False),
        ("text/plain;q=1, application/openmetrics-text;q=0.001", False),
        ("application/openmetrics-text;q=0.5, */*;q=0.1", True),
    ],
)
def test_openmetrics_is_sent_only_where_preferred(header: str, openmetrics: bool) -> None:
    assert wants_openmetrics(header) is openmetrics


def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact() -> None:
    token = b"s3cret"
    assert bearer_matches("Bearer s3cret", token)
    assert bearer_matches("bearer s3cret", token)
    assert bearer_matches("BEARER  s3cret", token)
    assert not bearer_matches("Bearer s3cre", token)
    assert not bearer_matches("Basic s3cret", token)
    assert not bearer_matches("s3cret", token)
    assert not bearer_matches("", token)
