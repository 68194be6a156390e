"""Everything the anomaly thread keeps of one device: its detectors, its recent feature vectors
and its model; a fixed amount per device."""

from __future__ import annotations

from array import array
from collections import deque
from typing import Protocol

from kepler_bridge.anomaly import UNUSUAL, detectors, errors, features, sensors, thermal
from kepler_bridge.anomaly.features import Features
from kepler_bridge.anomaly.forest import MIN_ROWS, Forest
from kepler_bridge.anomaly.signals import Hold
from kepler_bridge.model import DeviceAnomaly

ROWS = 720  # feature vectors kept per device for the model's next fit
FIRST_ROWS = ROWS // 4  # a device's first model waits for a quarter of its window
RATE_SPAN = 30.0  # seconds the model's rates are taken over
GAP = 120.0  # seconds without a reading of the device that reset the detectors' short-term state


class Detector(Protocol):
    kind: str
    sensitivity: float

    def update(self, f: Features, elapsed: float) -> bool: ...

    def gap(self) -> None: ...


def named(sensitivity: float) -> list[Detector]:
    """One detector per named failure mode, in KINDS order."""
    return [
        detectors.Stuck(sensitivity),
        thermal.Cooling(sensitivity),
        detectors.MemoryLeak(sensitivity),
        sensors.FrozenSensor(sensitivity),
        thermal.Throttling(sensitivity),
        errors.ErrorBurst(sensitivity),
    ]


def unusual_above(sensitivity: float) -> float:
    """The model's score from which a sample counts as unusual."""
    return 0.5 + 0.05 / sensitivity


class DeviceWatch:
    """The detectors and the model of one device, fed its samples in order."""

    def __init__(self, uuid: str, sensitivity: float, window: float) -> None:
        self.uuid = uuid
        self.detectors = named(sensitivity)
        self.sensitivity = sensitivity
        self.rows: deque[array[float]] = deque(maxlen=ROWS)  # doubles: a third of a list's bytes
        self.step = window / ROWS
        self.last: Features | None = None
        self.anchors: deque[Features] = deque(maxlen=4)
        self.last_row = float("-inf")
        self.first_row = float("inf")
        self.forest: Forest | None = None
        self.unusual = Hold(120.0, 120.0)
        self.firing: tuple[str, ...] = ()
        self.score: float | None = None

    def ready(self) -> bool:
        """Whether there are rows enough for a fit: for the first one, a quarter of the window
        (in rows or in time)."""
        rows = self.rows
        if len(rows) < MIN_ROWS:
            return False
        spanned = self.last_row - self.first_row >= self.step * FIRST_ROWS
        return self.forest is not None or len(rows) >= FIRST_ROWS or spanned

    def configure(self, sensitivity: float, window: float) -> None:
        """New settings: the detectors keep what they learned."""
        self.sensitivity = sensitivity
        for detector in self.detectors:
            detector.sensitivity = sensitivity
        self.step = window / ROWS

    def update(self, f: Features) -> DeviceAnomaly:
        """Take one sample of the device; what fires after it."""
        last, self.last = self.last, f
        elapsed = f.timestamp - last.timestamp if last is not None else 0.0
        if last is not None and not 0.0 <= elapsed <= GAP:  # unread a while, or the clock went back
            self.gap()
            last, elapsed = None, 0.0
        if f.timestamp < self.last_row:  # the clock went back: rows go on from now
            self.last_row = float("-inf")
        firing = [d.kind for d in self.detectors if d.update(f, elapsed)]
        vector = features.vector(f, self._anchor(f))
        if vector is None:
            self.score = None
        elif f.timestamp - self.last_row >= self.step:
            self.rows.append(array("d", vector))
            self.last_row = f.timestamp
            self.first_row = min(self.first_row, f.timestamp)
            self._score(vector)
        elif self.score is None:
            self._score(vector)
        if self.forest is not None:
            above = self.score is not None and self.score >= unusual_above(self.sensitivity)
            if self.unusual.update(f.timestamp, above):
                firing.append(UNUSUAL)
        self.firing = tuple(firing)
        return self.report()

    def _score(self, vector: list[float]) -> None:
        """The model's score of a sample it would take as a row: once a row step (5 s of a 1-hour
        window), the resolution it learns the device at; its last score holds in between (50
        trees of a device cost some 0.1 ms a score)."""
        self.score = self.forest.score(vector) if self.forest is not None else None

    def _anchor(self, f: Features) -> Features | None:
        """The sample the rates are taken against: at least RATE_SPAN seconds old where there is
        one (rates over a second are mostly the readings' jitter)."""
        anchors = self.anchors
        if not anchors or f.timestamp - anchors[-1].timestamp >= RATE_SPAN / 2:
            anchors.append(f)
        old = [a for a in anchors if f.timestamp - a.timestamp >= RATE_SPAN]
        return old[-1] if old else anchors[0] if anchors[0] is not f else None

    def report(self) -> DeviceAnomaly:
        """What fires now, and the model's latest score."""
        fitted = self.forest.fitted_at if self.forest is not None else None
        return DeviceAnomaly(self.uuid, self.firing, self.score, fitted)

    def gap(self) -> None:
        """The device was down or unread: what held before says nothing of now."""
        for detector in self.detectors:
            detector.gap()
        self.unusual.reset()
        self.firing, self.score, self.last = (), None, None
        self.anchors.clear()
