"""A frozen sensor: a reading that normally moves stays bit-identical for many samples."""

from __future__ import annotations

from kepler_bridge.anomaly.features import Features
from kepler_bridge.anomaly.signals import Ewma, Hold

# A heat swing of the power limit over this moves a live sensor by a degree or more (some 0.1-0.3
# degrees a watt at the die, 70-700 W limits).
HEAT_FOR_A_DEGREE = 30.0


class Run:
    """One reading's current run of identical values, and what is usual for it: how often it
    changes from sample to sample, and how long its runs last (the longest, decaying by half a
    day)."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.since = 0.0
        self.samples = 0
        self.moving = Ewma(1800.0)
        self.longest = 0.0
        self.driver_low = self.driver_high = 0.0  # range of its driving reading during the run

    def update(self, value: float, now: float, elapsed: float, driver: float | None) -> None:
        if value != self.value:
            if self.value is not None:
                self.longest = max(self.longest * 0.5 ** ((now - self.since) / 43200.0), 0.0)
                self.longest = max(self.longest, now - self.since)
            self.value, self.since, self.samples = value, now, 0
            self.driver_low = self.driver_high = driver or 0.0
        self.samples += 1
        if self.samples <= 3:  # a long run does not teach it that the reading stands still
            self.moving.update(float(self.samples == 1), elapsed)
        if driver is not None:
            self.driver_low, self.driver_high = (
                min(self.driver_low, driver),
                max(self.driver_high, driver),
            )

    def frozen(self, now: float, driven: float, sensitivity: float, habit: bool = True) -> bool:
        """Whether its driver moved by more than `driven` while it stood still, or (`habit`) the
        run is far longer than is usual for this reading."""
        length = now - self.since
        if self.samples < 20 or length < 90.0:
            return False
        usual = habit and self.moving.seen >= 600.0 and self.moving.value >= 0.25
        unusual = usual and length >= max(120.0, 4.0 * self.longest) / sensitivity
        return unusual or self.driver_high - self.driver_low >= driven / sensitivity


class FrozenSensor:
    """Power, temperature or utilization bit-identical for at least 20 samples and 90 s, where the
    reading usually changes (in a quarter of its samples or more) and the run is four times its
    longest in half a day (for temperature, only while the heat moved), or while what drives it
    moved a lot.

    Power sensors report milliwatts and jitter every read; temperature must follow a swing of
    a tenth of the board's power (a few degrees) within a minute or two; utilization at neither
    0 nor 100 % is a sampled ratio. A value that does not move is a sensor, a driver or a
    management controller that stopped updating and hands back its last value."""

    kind = "frozen_sensor"

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.runs = {"power": Run(), "temperature": Run(), "utilization": Run()}
        self.heat = Ewma(30.0)  # power smoothed as the die's temperature follows it
        self.hold = Hold(0.0, 30.0)

    def update(self, f: Features, elapsed: float) -> bool:
        now, runs, s = f.timestamp, self.runs, self.sensitivity
        limit = f.power_limit or 1000.0
        frozen = False
        if f.power is not None:
            run = runs["power"]
            run.update(f.power, now, elapsed, f.utilization)
            # An idle board's power, averaged and in whole watts (amdgpu), settles as its
            # temperature does: a long run is unusual only where the board worked during it.
            worked = f.utilization is None or run.driver_high > 0.05
            frozen = run.frozen(now, 0.4, s, habit=worked)
        if f.temperature is not None:
            heat = self.heat.update(f.power, elapsed) if f.power is not None else None
            run = runs["temperature"]
            run.update(f.temperature, now, elapsed, heat)
            # Whole degrees stand still while the heat does (an idle board): a long run is
            # unusual only where the heat moved by what shows as a degree or more.
            heated = run.driver_high - run.driver_low >= limit / HEAT_FOR_A_DEGREE
            frozen = frozen or run.frozen(now, limit / 10.0, s, habit=heated)
        if f.utilization is not None and 0.0 < f.utilization < 1.0:
            runs["utilization"].update(f.utilization, now, elapsed, None)
            frozen = frozen or runs["utilization"].frozen(now, float("inf"), s)
        else:
            runs["utilization"].value = None  # idle or saturated: a run that says nothing
        return self.hold.update(now, frozen)

    def gap(self) -> None:
        self.hold.reset()
        self.runs = {name: _kept(run) for name, run in self.runs.items()}


def _kept(run: Run) -> Run:
    """A fresh run that keeps what is usual for the reading."""
    fresh = Run()
    fresh.moving, fresh.longest = run.moving, run.longest
    return fresh
