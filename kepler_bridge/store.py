"""The newest snapshot and the recent history: what the sampler publishes and every reader takes."""

from __future__ import annotations

import math
import threading
from array import array
from operator import attrgetter
from typing import Callable, NamedTuple

from kepler_bridge.model import Anomalies, Snapshot, replaced
from kepler_bridge.turns import TURNS

MAX_SAMPLES = 300
MAX_SECONDS = 300.0
# What the live page charts per device; a sample keeps these and nothing else.
FIELDS = ("utilization", "memory_used_bytes", "temperature_celsius", "power_watts")
_FIELDS, _NONE = attrgetter(*FIELDS), (None,) * len(FIELDS)


class Sample(NamedTuple):
    """One snapshot summarised: FIELDS per device in `uuids` order, rounded, NaN where a device
    reported nothing."""

    timestamp: float
    uuids: tuple[
        str, ...
    ]  # the previous sample's tuple when the devices did not change, so it is shared
    values: array


class History:
    """The newest samples, at most MAX_SAMPLES and MAX_SECONDS; one writer, readers never lock."""

    def __init__(self) -> None:
        self._samples: tuple[Sample, ...] = ()

    def add(self, snapshot: Snapshot) -> None:
        """Append the snapshot's summary and drop what falls out of the window."""
        samples = self._samples
        uuids = tuple([gpu.uuid for gpu in snapshot.gpus])
        if samples and samples[-1].uuids == uuids:
            uuids = samples[-1].uuids
        values = array(
            "d",
            [
                math.nan if value is None else round(float(value), 3)
                for gpu in snapshot.gpus
                for value in (_FIELDS(gpu) if gpu.up else _NONE)
            ],
        )
        oldest = snapshot.timestamp - MAX_SECONDS
        # Samples come in time order, so the old ones are at the front: a slice, not a walk.
        # (A wall clock stepped back keeps the samples ahead of it until the count drops them.)
        start = max(0, len(samples) - (MAX_SAMPLES - 1))
        while start < len(samples) and samples[start].timestamp <= oldest:
            start += 1
        self._samples = (*samples[start:], Sample(snapshot.timestamp, uuids, values))

    def samples(self) -> tuple[Sample, ...]:
        """The samples held now, oldest first."""
        return self._samples


class SnapshotStore:
    """Holds the newest snapshot and the recent history; publication is one reference swap, so
    readers never lock."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self.history = History()
        self._preparers: list[Callable[[Snapshot], None]] = []
        # The anomaly thread's latest findings, attached to each snapshot published after them.
        self.anomalies: Anomalies | None = None
        self.published = threading.Event()  # set at each publication; its waiter clears it

    def prepare_with(self, prepare: Callable[[Snapshot], None]) -> None:
        """Have `prepare` run on each snapshot before it is published, in the publishing thread."""
        self._preparers.append(prepare)

    def publish(self, snapshot: Snapshot) -> None:
        if self.anomalies is not None:
            snapshot = replaced(snapshot, anomalies=self.anomalies)
        self.history.add(snapshot)  # first: whoever sees the snapshot finds it in the history
        for prepare in self._preparers:
            TURNS.give_way()
            prepare(snapshot)
        TURNS.give_way()
        self._snapshot = snapshot
        self.published.set()

    def latest(self) -> Snapshot | None:
        return self._snapshot
