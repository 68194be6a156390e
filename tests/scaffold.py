"""The test scaffold: one way each to read /metrics text, build settings, poll, pick a port and
state what the machine must offer (tests/README.md)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kepler_bridge import config


def require(condition: object, why: str) -> None:
    """A precondition on this machine (root, cgroup v2, a kernel feature): without it the test
    fails when the environment variable CI is set, and is skipped elsewhere."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI must offer it; outside CI this test is skipped)", pytrace=False)
    pytest.skip(f"{why} (CI fails here instead of skipping)")


def families(text: str) -> dict[str, Metric]:
    """The metric families of a /metrics text, by family name."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str, name: str | None = None) -> list[Sample]:
    """The samples of a /metrics text in order; only those called `name` when it is given."""
    return [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if name is None or sample.name == name
    ]


def values(text: str, name: str, label: str) -> dict[str, float]:
    """Values of one metric keyed by one label ('' where a sample lacks the label)."""
    return {sample.labels.get(label, ""): sample.value for sample in samples(text, name)}


def by_name(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of a /metrics text."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for sample in samples(text):
        found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def source_states(text: str) -> dict[str, str]:
    """Each source's state (up, down, standby, absent) from kepler_bridge_source_state."""
    return {
        sample.labels["source"]: sample.labels["state"]
        for sample in samples(text, "kepler_bridge_source_state")
        if sample.value == 1
    }


def make_config(**settings: object) -> config.Config:
    """Settings as the flags would give them (each value as its text), with no environment."""
    return config.load({key: str(value) for key, value in settings.items()}, {})


def wait_for(
    check: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    step: float = 0.1,
    ignore: tuple[type[Exception], ...] = (),
    log: Callable[[], str] | None = None,
) -> Any:
    """Poll check() until it returns something truthy and return that; an exception of a type in
    `ignore` counts as not yet. Fails naming `what` (and the tail of `log`) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except ignore:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            tail = f"; log:\n{log()[-3000:]}" if log else ""
            raise AssertionError(f"{what} not met within {timeout:g} s{tail}")
        time.sleep(step)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stat_line(pid: int, comm: str, utime: int, stime: int, start: int) -> str:
    """A /proc/<pid>/stat line with these CPU times (clock ticks) and start time."""
    fields = [
        "S",
        "1",
        str(pid),
        str(pid),
        "0",
        "-1",
        "4194560",
        "100",
        "0",
        "0",
        "0",
        str(utime),
        str(stime),
        "0",
        "0",
        "20",
        "0",
        "1",
        "0",
        str(start),
        "1000000",
        "100",
    ]
    return f"{pid} ({comm}) {' '.join(fields)}\n"
