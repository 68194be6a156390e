"""The newest snapshot and the recent history: what the sampler publishes and every reader takes."""

from __future__ import annotations

from kepler_bridge.live import History
from kepler_bridge.model import Snapshot


class SnapshotStore:
    """Holds the newest snapshot and the recent history; publication is one reference swap, so readers never lock."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self.history = History()

    def publish(self, snapshot: Snapshot) -> None:
        self.history.add(snapshot)  # first: whoever sees the snapshot finds it in the history
        self._snapshot = snapshot

    def latest(self) -> Snapshot | None:
        return self._snapshot
