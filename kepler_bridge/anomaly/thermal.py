"""The thermal failure modes of one device: cooling that degrades, and clocks held down more than
this device's own history makes usual."""

from __future__ import annotations

from collections import deque

from kepler_bridge.anomaly.features import Features
from kepler_bridge.anomaly.signals import Ewma, Hold

BINS = 10
ROOM_RATE = 3.0 / 3600.0  # °C a second: the fastest a room's (an inlet's) air warms or cools


class Cooling:
    """Temperature well above what this device reaches at the same power, or the fan at its
    maximum while temperature still climbs at steady power.

    At steady state a die sits at ambient plus power times the thermal resistance of its heatsink
    and airflow; a failed fan, a clogged filter or dried thermal paste raise that resistance, so the
    same watts give more degrees. The learned curve is per power band (power smoothed over a
    minute, the die's thermal lag, and temperature with it), learned slowly and hardly at all
    from samples far off it.

    The room's temperature moves every band alike, and a band learns only while visited: one
    taught at night would take the afternoon's warmer room for a fault. So the bands learn the
    curve less a room offset, shared by all, that follows what a band is off by when the device
    comes back to it (a band first learned now says nothing of the room: following it took the
    curve's own rise through a morning's new bands for a room 10 °C warmer); only from samples
    within the band's margin, not from suspect ones, and never faster than a room changes
    (ROOM_RATE), where a failed fan raises the die tens of degrees in minutes: the offset neither
    takes in a fault nor teaches it to the bands. A band's mean is the curve at its middle, and
    the line to its neighbour's gives the curve elsewhere in it (a rising load sits high in each
    band it crosses, which the offset took for a warmer room too)."""

    kind = "cooling"

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.power = Ewma(90.0)  # lags as much as the smoothed temperature and the die's own lag
        self.temperature = Ewma(45.0)  # smoothed, so that bursts cancel out of the residual
        self.bands = [Ewma(7200.0) for _ in range(BINS)]
        self.spread = [Ewma(7200.0, 1.0) for _ in range(BINS)]
        self.room = 0.0  # °C the room is above where the bands learned it
        self.visiting, self.returned = -1, False  # the band now, and whether it was known then
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=40)  # (t, °C, W), 10 s apart
        self.limit: float | None = None  # the power limit the bands are shares of
        self.hold = Hold(60.0, 120.0)

    def update(self, f: Features, elapsed: float) -> bool:
        if f.temperature is None or f.power is None:
            return self.hold.update(f.timestamp, False)
        watts = self.power.update(f.power, elapsed)
        degrees = self.temperature.update(f.temperature, elapsed)
        limit = f.power_limit or 1000.0
        if self.limit is not None and abs(limit - self.limit) > 0.02 * self.limit:
            # The bands are shares of the limit: a new limit (nvidia-smi -pl) puts other watts in
            # each, so what they learned no longer holds.
            self.bands = [Ewma(7200.0) for _ in range(BINS)]
            self.spread = [Ewma(7200.0, 1.0) for _ in range(BINS)]
            self.room, self.visiting = 0.0, -1
        self.limit = limit
        share = watts / limit * BINS
        band = min(BINS - 1, max(0, int(share)))
        # A die still cooling down after its load dropped is above the lower band, not failing.
        falling = len(self.recent) >= 7 and degrees < self.recent[-7][1] - 0.5
        hot = self._hot(band, share, degrees, elapsed, self._settled(degrees)) and not falling
        if not self.recent or f.timestamp - self.recent[-1][0] >= 10.0:
            self.recent.append((f.timestamp, degrees, watts))
        return self.hold.update(f.timestamp, hot or self._climbing_at_full_fan(f))

    def _settled(self, degrees: float) -> bool:
        """Whether the die's temperature is at its steady state (within 1 °C of a minute ago):
        only then does it teach the curve, so a die still warming up does not."""
        return len(self.recent) >= 7 and abs(degrees - self.recent[-7][1]) < 1.0

    def _hot(
        self, band: int, share: float, temperature: float, elapsed: float, settled: bool
    ) -> bool:
        mean, spread = self.bands[band], self.spread[band]
        known = mean.seen >= 600.0
        margin = max(5.0, 4.0 * spread.value) / self.sensitivity
        # The band's mean is its middle's: where in the band the power is moves the curve too.
        tilt = self._tilt(band, share)
        excess = temperature - self.room - mean.value - tilt if known else 0.0
        # A sample far above the curve teaches it 50 times slower, so a fault is not learned away.
        learn = (elapsed if excess < margin else elapsed / 50.0) if settled else 0.0
        if band != self.visiting:
            self.visiting, self.returned = band, known
        if self.returned and abs(excess) < margin:
            self._follow_room(excess, elapsed)
        if known:
            spread.update(abs(excess), learn)
        mean.update(temperature - self.room - tilt, learn)
        return excess >= margin

    def _tilt(self, band: int, share: float) -> float:
        """How much warmer than the band's middle the curve is at `share`, in the line to the
        nearer known neighbouring band (the other one where only it is known)."""
        offset = max(-0.5, min(0.5, share - band - 0.5))
        if self.bands[band].seen < 600.0:
            return 0.0
        lower = band > 0 and self.bands[band - 1].seen >= 600.0
        upper = band < BINS - 1 and self.bands[band + 1].seen >= 600.0
        if not (lower or upper):
            return 0.0
        other = band + 1 if upper and (offset > 0 or not lower) else band - 1
        slope = (self.bands[other].value - self.bands[band].value) / (other - band)
        return max(0.0, slope) * offset

    def _follow_room(self, excess: float, elapsed: float) -> None:
        """Move the room offset a share of `excess` (a 30-minute half-life), at most ROOM_RATE."""
        elapsed = max(elapsed, 0.0)
        step = excess * (1.0 - 0.5 ** (elapsed / 1800.0))
        self.room += max(-ROOM_RATE * elapsed, min(ROOM_RATE * elapsed, step))

    def _climbing_at_full_fan(self, f: Features) -> bool:
        if f.fan is None or f.fan < 0.95 or len(self.recent) < 13:
            return False
        t0, temp0, watts0 = self.recent[-13]
        t1, temp1, watts1 = self.recent[-1]
        steady = abs(watts1 - watts0) <= 0.05 * (f.power_limit or max(watts0, 1.0))
        return steady and (temp1 - temp0) / max(t1 - t0, 1.0) * 60.0 >= 1.0 / self.sensitivity

    def gap(self) -> None:
        self.hold.reset()
        self.recent.clear()


class Throttling:
    """Clocks held down (a thermal, hardware or power-brake slowdown, the power cap while power is
    under the limit, or the SM clock well under the clock this device usually runs busy at) far
    more than is usual for this device.

    A board that always runs at its power cap is healthy at 100 % capped; one that never throttles
    and now does most of the time has a failing power supply, a hot inlet or a power brake
    asserted. The baseline is six hours of this device's own busy samples."""

    kind = "throttling"

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.clock = Ewma(7200.0)
        self.short = Ewma(30.0)
        self.usual = Ewma(6 * 3600.0)
        self.hold = Hold(60.0, 120.0)
        self.idle_since: float | None = None

    def update(self, f: Features, elapsed: float) -> bool:
        if f.utilization is None or f.utilization < 0.3:
            # An idle GPU clocks down: says nothing either way while it comes and goes, but an
            # alarm does not outlast the work it was about by more than its clear time.
            if self.idle_since is None:
                self.idle_since = f.timestamp
            elif f.timestamp - self.idle_since >= self.hold.clear:
                self.hold.reset()
            return self.hold.firing
        self.idle_since = None
        # The power cap at the power limit is the board's setting at work; under it, a fault.
        at_limit = f.power is not None and f.power >= 0.9 * (f.power_limit or float("inf"))
        slow = f.throttled or (f.power_capped and not at_limit)
        if f.sm_clock is not None and not at_limit:
            known = self.clock.seen >= 600.0
            slow = slow or (known and f.sm_clock < 0.85 * self.clock.value)
            if not slow:
                self.clock.update(f.sm_clock, elapsed)
        short = self.short.update(float(slow), elapsed)
        usual = self.usual.update(float(slow), elapsed)
        warm = self.usual.seen >= 1800.0
        margin = min(0.9, 0.4 / self.sensitivity)
        return self.hold.update(f.timestamp, warm and short >= 0.6 and short - usual >= margin)

    def gap(self) -> None:
        self.hold.reset()
        self.short = Ewma(self.short.half_life)
