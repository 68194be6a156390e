"""Error bursts: XID events, ECC errors or remapped rows counting faster than this device's
baseline."""

from __future__ import annotations

from collections import deque
from typing import Sequence

from kepler_bridge.anomaly.features import Features
from kepler_bridge.anomaly.signals import Ewma, Hold

WINDOW = 600.0
# Per counter (XID, corrected ECC, uncorrected ECC, remapped rows): how many more than the
# baseline expects in the window make a burst. An uncorrected error or a remapped row is one too
# many: the memory lost data or a spare row.
EXCESS = (3.0, 10.0, 1.0, 1.0)
NONE = (0,) * len(EXCESS)  # the increases of a sample that counted none


class ErrorBurst:
    """More XID events, ECC errors or remapped rows in ten minutes than the device's own day-long
    rate explains.

    Corrected ECC errors trickle on a healthy board and an application's own fault (XID 13, 31,
    43) turns up now and then; a burst of them, or any uncorrectable error, is a failing memory
    chip, a bad PCIe or NVLink path or a driver fault, and precedes the GPU falling off the bus."""

    kind = "error_burst"

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.last: tuple[int | None, ...] | None = None  # each counter's last known value
        self.events: deque[tuple[float, int, int]] = deque(maxlen=256)  # (t, counter, increase)
        self.rates = [Ewma(86400.0) for _ in EXCESS]  # increases per second
        self.hold = Hold(0.0, 60.0)

    def update(self, f: Features, elapsed: float) -> bool:
        now = f.timestamp
        last = self.last or f.errors
        # A counter the device did not give this time keeps its last value: back, it has grown
        # by what it counted meanwhile, not by its whole value.
        self.last = tuple(old if new is None else new for new, old in zip(f.errors, last))
        increases: Sequence[int] = NONE
        if self.last != last:
            increases = [
                0 if new is None or old is None else max(0, new - old)
                for new, old in zip(self.last, last)
            ]
        for counter, increase in enumerate(increases):
            if increase:
                self.events.append((now, counter, increase))
            if elapsed > 0:
                self.rates[counter].update(increase / elapsed, elapsed)
        while self.events and self.events[0][0] < now - WINDOW:
            self.events.popleft()
        return self.hold.update(now, self._burst())

    def _burst(self) -> bool:
        counts = [0.0] * len(EXCESS)
        for _, counter, increase in self.events:
            counts[counter] += increase
        for counter, count in enumerate(counts):
            expected = 4.0 * self.rates[counter].value * WINDOW
            if count and count >= expected + max(1.0, EXCESS[counter] / self.sensitivity):
                return True
        return False

    def gap(self) -> None:
        self.hold.reset()
