"""Turns snapshots into bytes, once per snapshot and variant."""

from __future__ import annotations

import gzip
import threading
from typing import Callable, Mapping

from kepler_bridge.config import Config
from kepler_bridge.exposition import baetyl, prometheus
from kepler_bridge.model import Snapshot
from kepler_bridge.store import SnapshotStore

# Variant name -> renderer; "+gzip" variants are the compressed bytes of the plain one.
_RENDERERS: dict[str, Callable[[Snapshot, Config], bytes]] = {
    "text": lambda snap, cfg: prometheus.render(snap, cfg.metric_allowed),
    "openmetrics": lambda snap, cfg: prometheus.render(snap, cfg.metric_allowed, openmetrics=True),
    "baetyl": lambda snap, cfg: baetyl.render(snap, cfg.baetyl_memory_unit),
}


class RenderCache:
    """Bytes of the newest snapshot per variant, made lazily on first request and reused; `extra` adds variants."""

    def __init__(self, store: SnapshotStore, settings: Callable[[], Config],
                 extra: Mapping[str, Callable[[Snapshot, Config], bytes]] | None = None) -> None:
        """`settings`: the settings in force now (they change on reload; a render uses those of its moment)."""
        self.store = store
        self.settings = settings
        self._renderers = {**_RENDERERS, **(extra or {})}
        self._lock = threading.Lock()
        # One reference, swapped whole, so a reader never pairs a snapshot with another one's bytes.
        self._entry: tuple[Snapshot | None, dict[str, bytes]] = (None, {})

    def get(self, variant: str) -> tuple[Snapshot, bytes] | None:
        """The newest snapshot and its rendering, or None before the first sample."""
        snapshot = self.store.latest()
        if snapshot is None:
            return None
        cached_snapshot, rendered = self._entry
        if cached_snapshot is snapshot and variant in rendered:
            return snapshot, rendered[variant]
        with self._lock:
            if self._entry[0] is not snapshot:
                self._entry = (snapshot, {})
            rendered = self._entry[1]
            if variant not in rendered:
                self._render(snapshot, variant, rendered)
            return snapshot, rendered[variant]

    def _render(self, snapshot: Snapshot, variant: str, rendered: dict[str, bytes]) -> None:
        base, _, encoding = variant.partition("+")
        if base not in rendered:
            rendered[base] = self._renderers[base](snapshot, self.settings())
        if encoding == "gzip":
            rendered[variant] = gzip.compress(rendered[base], compresslevel=6)
