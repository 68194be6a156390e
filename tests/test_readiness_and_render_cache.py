"""/readyz turns 503 when the newest sample is stale; each snapshot is rendered once per variant."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent import Agent
from kepler_bridge.exposition import RenderCache, RenderSettings
from kepler_bridge.model import Snapshot, SourceStatus
from kepler_bridge.store import SnapshotStore
from scaffold import make_config


@pytest.mark.e2e
def test_readyz_is_503_while_a_hung_command_holds_the_sampler(tmp_path: Path) -> None:
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    # One sample waits the command's 3 s timeout: far past 3 intervals of 0.2 s.
    with Agent(
        "--simulate",
        "1",
        "--sources",
        "simulated",
        "--interval",
        "0.2s",
        "--command",
        str(hang),
        "--command-timeout",
        "3s",
        ready=False,
    ) as agent:
        stale = agent.wait_for(
            lambda: (r := agent.get("/readyz")).status_code == 503 and "old" in r.text and r.json(),
            timeout=15,
            what="/readyz reporting a stale sample",
        )
        assert "more than 3 intervals" in stale["reason"]
        assert agent.get("/healthz").status_code == 200  # alive: the sampler is slow, not dead


def _snapshot(stamp: float) -> Snapshot:
    return Snapshot(
        node="n",
        timestamp=stamp,
        duration_seconds=0.0,
        interval_seconds=1.0,
        sources=(SourceStatus("simulated", True, "", 0),),
    )


def test_each_snapshot_is_rendered_once_per_variant_however_many_readers() -> None:
    store = SnapshotStore()
    calls: list[float] = []

    def render(snapshot: Snapshot, _config) -> bytes:
        calls.append(snapshot.timestamp)
        return f"{snapshot.timestamp}".encode()

    settings = RenderSettings.of(make_config(sources="simulated"))
    cache = RenderCache(store, lambda: settings, {"probe": render})
    assert cache.get("probe") is None
    store.publish(_snapshot(1.0))
    readers = [
        threading.Thread(target=lambda: [cache.get(v) for v in ("probe", "probe+gzip") * 50])
        for _ in range(8)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert calls == [1.0]
    store.publish(_snapshot(2.0))
    assert cache.get("probe")[1] == b"2.0" and cache.get("probe+gzip")[0].timestamp == 2.0
    assert calls == [1.0, 2.0]


def _probe_cache() -> tuple[SnapshotStore, RenderCache, list[float]]:
    store = SnapshotStore()
    calls: list[float] = []

    def render(snapshot: Snapshot, _config) -> bytes:
        calls.append(snapshot.timestamp)
        return f"{snapshot.timestamp}".encode()

    settings = RenderSettings.of(make_config(sources="simulated"))
    return store, RenderCache(store, lambda: settings, {"probe": render}), calls


def test_a_steady_scrapers_variant_is_made_before_the_next_snapshot_is_published() -> None:
    store, cache, calls = _probe_cache()
    for stamp in (1.0, 2.0):
        store.publish(_snapshot(stamp))
        assert cache.made("probe") is None  # asked for: made on request, never by `made`
        assert cache.get("probe")[1] == f"{stamp}".encode()
    store.publish(_snapshot(3.0))  # asked for during each of the last two snapshots
    assert calls == [1.0, 2.0, 3.0]
    assert cache.made("probe") == b"3.0" and cache.get("probe")[1] == b"3.0"
    assert calls == [1.0, 2.0, 3.0]


def test_a_variant_asked_for_now_and_then_is_only_made_on_request() -> None:
    # A scrape every 15 s at a 1 s interval: making each snapshot's bytes ahead would be waste.
    store, cache, calls = _probe_cache()
    for stamp in (1.0, 2.0, 3.0, 4.0, 5.0):
        store.publish(_snapshot(stamp))
        if stamp % 2:
            assert cache.get("probe")[1] == f"{stamp}".encode()
    assert calls == [1.0, 3.0, 5.0]
