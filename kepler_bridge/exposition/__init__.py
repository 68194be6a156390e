"""Turns snapshots into bytes, once per snapshot and variant."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from kepler_bridge.config import Config
from kepler_bridge.exposition import baetyl, dcgm, prometheus
from kepler_bridge.model import Snapshot
from kepler_bridge.store import SnapshotStore


@dataclass(frozen=True)
class RenderSettings:
    """What the renderers need: the allow/deny prefixes and the metric names of /metrics, and the
    memory unit of /v1/collect."""

    metrics_allow: tuple[str, ...]
    metrics_deny: tuple[str, ...]
    memory_unit: str
    metric_names: str = "kepler"

    @classmethod
    def of(cls, config: Config) -> RenderSettings:
        """The render settings within the agent's settings."""
        return cls(
            config.metrics_allow,
            config.metrics_deny,
            config.baetyl_memory_unit,
            config.metric_names,
        )

    def metric_allowed(self, name: str) -> bool:
        """Whether a metric name passes the allow/deny prefixes."""
        if self.metrics_allow and not name.startswith(self.metrics_allow):
            return False
        return not (self.metrics_deny and name.startswith(self.metrics_deny))


def _metrics(snapshot: Snapshot, settings: RenderSettings, openmetrics: bool = False) -> bytes:
    """/metrics: the accelerator series under our names, or dcgm-exporter's (--metric-names)."""
    devices = dcgm.families if settings.metric_names == "dcgm" else None
    return prometheus.render(snapshot, settings.metric_allowed, openmetrics, devices)


# Variant name -> renderer; "+gzip" variants are the compressed bytes of the plain one.
RENDERERS: dict[str, Callable[[Snapshot, RenderSettings], bytes]] = {
    "text": lambda snap, settings: _metrics(snap, settings),
    "openmetrics": lambda snap, settings: _metrics(snap, settings, openmetrics=True),
    "baetyl": lambda snap, settings: baetyl.render(snap, settings.memory_unit),
}


class RenderCache:
    """Bytes of the newest snapshot per variant, made on first request and reused; `extra` adds
    variants. A variant asked for during each of the last two snapshots is made for the next one
    before it is published (in the sampler's thread), so a steady scraper finds its bytes made."""

    def __init__(
        self,
        store: SnapshotStore,
        settings: Callable[[], RenderSettings],
        extra: Mapping[str, Callable[[Snapshot, RenderSettings], bytes]] | None = None,
    ) -> None:
        """`settings`: the render settings in force now (they change on reload; a render uses those
        of its moment)."""
        self.store = store
        self.settings = settings
        self._renderers = {**RENDERERS, **(extra or {})}
        self._lock = threading.Lock()
        # One reference each, swapped whole, so a reader never pairs a snapshot with another one's
        # bytes: the newest snapshot's renderings, and those made for the one being published.
        self._entry: tuple[Snapshot | None, dict[str, bytes]] = (None, {})
        self._next: tuple[Snapshot | None, dict[str, bytes]] = (None, {})
        # Variants asked for during the newest snapshot and during the one before; set.add and
        # copying a set are atomic under the GIL, so readers add without a lock.
        self._asked: set[str] = set()
        self._asked_before: set[str] = set()
        store.prepare_with(self._prepare)

    def made(self, variant: str) -> bytes | None:
        """The newest snapshot's rendering if it is made already, else None: never renders, so the
        event loop may ask."""
        snapshot = self.store.latest()
        if snapshot is None:
            return None
        self._asked.add(variant)
        rendered = self._rendered(snapshot)
        return rendered.get(variant) if rendered is not None else None

    def get(self, variant: str) -> tuple[Snapshot, bytes] | None:
        """The newest snapshot and its rendering, or None before the first sample."""
        snapshot = self.store.latest()
        if snapshot is None:
            return None
        self._asked.add(variant)
        rendered = self._rendered(snapshot)
        if rendered is not None and variant in rendered:
            return snapshot, rendered[variant]
        with self._lock:
            if self._entry[0] is not snapshot:
                self._entry = self._next if self._next[0] is snapshot else (snapshot, {})
            rendered = self._entry[1]
            if variant not in rendered:
                self._render(snapshot, variant, rendered)
            return snapshot, rendered[variant]

    def _rendered(self, snapshot: Snapshot) -> dict[str, bytes] | None:
        for entry in (self._entry, self._next):
            if entry[0] is snapshot:
                return entry[1]
        return None

    def _prepare(self, snapshot: Snapshot) -> None:
        """Before `snapshot` is published: make the variants asked for during each of the last two
        snapshots."""
        asked, self._asked = set(self._asked), set()
        steady, self._asked_before = asked & self._asked_before, asked
        rendered: dict[str, bytes] = {}
        for variant in sorted(steady):
            try:
                self._render(snapshot, variant, rendered)
            except Exception:  # it fails again, and is reported, in the request asking for it
                rendered.pop(variant, None)
        self._next = (snapshot, rendered)

    def _render(self, snapshot: Snapshot, variant: str, rendered: dict[str, bytes]) -> None:
        base, _, encoding = variant.partition("+")
        if base not in rendered:
            rendered[base] = self._renderers[base](snapshot, self.settings())
        if encoding == "gzip":
            rendered[variant] = gzip.compress(rendered[base], compresslevel=6)
