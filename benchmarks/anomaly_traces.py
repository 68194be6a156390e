"""Labelled accelerator traces for benchmarks/anomaly.py and tests/test_anomaly.py: normal
inference patterns, each failure mode injected at a known time, and faults the detectors were not
written for.

A trace is a list of `Features` samples (what the anomaly detectors read of a device) and the
fault's interval. The device follows simple physics: power follows the work asked for up to the
board's limit (then the power cap holds the clocks down), the die's temperature follows power
through a thermal resistance with a minute's lag and reads in whole degrees (as NVML gives it),
the fan follows temperature, power jitters by a watt or two and the temperature sensor by
0.4 °C (so a whole degree flickers at steady load, as a die's hot spot does).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kepler_bridge.anomaly.features import Features

GB = 1e9
PATTERNS = ("steady", "bursty", "diurnal", "idle_nights", "reloads")
FAULTS = ("stuck", "cooling", "memory_leak", "frozen_sensor", "throttling", "error_burst")
UNFORESEEN = ("power_drift", "reboot")
# Alarms a fault may raise besides its own kind: consequences, neither hits nor false alarms.
ALSO = {"cooling": {"throttling"}, "throttling": {"cooling"}, "stuck": {"throttling"}}


@dataclass
class Fault:
    kind: str
    start: float
    end: float


@dataclass
class Trace:
    name: str
    pattern: str
    seed: int
    samples: list[Features | None] = field(default_factory=list)  # None: the device was down
    fault: Fault | None = None


@dataclass
class Device:
    """One simulated board and its state."""

    rng: random.Random
    limit: float
    idle: float
    resistance: float  # °C per W
    ambient: float
    memory_total: float
    model_bytes: float
    capped: bool  # asks for more than its power limit when busy: always at its power cap
    temperature: float = 35.0
    pids: frozenset[int] = frozenset()
    errors: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    ecc_rate: float = 0.0  # corrected ECC errors per hour on this healthy board


def device(seed: int) -> Device:
    rng = random.Random(seed)
    limit = rng.choice((300.0, 400.0, 700.0))
    return Device(
        rng=rng,
        limit=limit,
        idle=limit * rng.uniform(0.08, 0.15),
        resistance=rng.uniform(40.0, 55.0) / limit,
        ambient=rng.uniform(24.0, 32.0),
        memory_total=80 * GB,
        model_bytes=rng.uniform(20, 50) * GB,
        capped=rng.random() < 0.3,
        pids=frozenset(rng.sample(range(1000, 60000), rng.randint(1, 3))),
        ecc_rate=rng.choice((0.0, 0.0, 0.5, 2.0)),
    )


def load(pattern: str, t: float, rng: random.Random, level: float = 0.7) -> float:
    """The work asked of the device at time t (seconds from midnight), 0..1."""
    hour = (t / 3600.0) % 24
    if pattern == "steady":  # a server at its own level, some saturated
        return min(1.0, max(0.0, level + rng.gauss(0, 0.04)))
    if pattern == "bursty":
        return rng.uniform(0.9, 1.0) if rng.random() < 0.35 else rng.uniform(0.0, 0.1)
    if pattern == "diurnal":
        day = max(0.0, math.sin(2 * math.pi * (hour - 6) / 24))
        return min(1.0, max(0.0, 0.1 + 0.8 * day + rng.gauss(0, 0.05)))
    if pattern == "idle_nights":
        return 0.0 if hour < 8 or hour >= 20 else min(1.0, max(0.0, rng.gauss(0.8, 0.1)))
    return min(1.0, max(0.0, 0.6 + rng.gauss(0, 0.08)))  # reloads: serving, reloads added


def busy(pattern: str, t: float) -> bool:
    """Whether the pattern keeps the device at work at t: faults that need load start then."""
    hour = (t / 3600.0) % 24
    return pattern != "idle_nights" or 8 <= hour < 20


class Sim:
    """A device running one pattern, sample after sample, with at most one fault."""

    def __init__(self, pattern: str, seed: int, fault: Fault | None, unforeseen: str = "") -> None:
        self.pattern, self.fault, self.unforeseen = pattern, fault, unforeseen
        self.dev = device(seed)
        self.rng = random.Random(seed * 7919 + PATTERNS.index(pattern))
        self.memory = self.dev.model_bytes
        self.frozen: Features | None = None
        self.leaked = 0.0
        self.reload_at = 3600.0 * self.rng.uniform(1, 2)
        self.level = random.Random(seed).choice((0.5, 0.7, 0.97))

    def active(self, t: float) -> str:
        fault = self.fault
        return fault.kind if fault is not None and fault.start <= t < fault.end else ""

    def sample(self, t: float, dt: float) -> Features | None:
        dev, rng, kind = self.dev, self.rng, self.active(t)
        util = load(self.pattern, t, rng, self.level)
        util = self._reload(t, util)
        demand = dev.idle + (dev.limit - dev.idle) * util * (1.15 if dev.capped else 0.95)
        capped = demand > dev.limit
        power = min(demand, dev.limit) + rng.gauss(0, 1.5)
        clock = (0.21 + 1.77 * min(1.0, util * 4)) * 1e9 * (0.9 if capped else 1.0)
        throttled = False
        if kind == "stuck":
            util, power, clock = 1.0, dev.idle * 1.08 + rng.gauss(0, 1.5), 1.98e9
        if kind == "throttling":
            throttled, clock, power = True, clock * 0.6, power * 0.7
        if self.unforeseen == "power_drift" and self.fault is not None and t >= self.fault.start:
            power *= 1.0 + 0.25 * min(1.0, (t - self.fault.start) / (12 * 3600.0))
        resistance = dev.resistance * (1.7 if kind == "cooling" else 1.0)
        target = dev.ambient + resistance * power
        dev.temperature += (target - dev.temperature) * min(1.0, dt / 60.0)
        fan = min(1.0, max(0.3, 0.3 + (dev.temperature - 45.0) / 40.0))
        fan = 1.0 if kind == "cooling" else fan
        self._errors(t, dt, kind)
        memory = self._memory(t, dt, util, kind)
        f = Features(
            t, round(util, 2), float(int(memory)), dev.memory_total,
            float(round(dev.temperature + rng.gauss(0, 0.4))),
            round(max(power, 1.0), 3), dev.limit, clock, 1.593e9, round(fan, 2), throttled,
            (dev.errors[0], dev.errors[1], dev.errors[2], dev.errors[3]), dev.pids, capped,
        )  # fmt: skip
        return self._freeze(f, kind)

    def _reload(self, t: float, util: float) -> float:
        """reloads: every 2 h the model is reloaded in place (a minute idle, memory out and in);
        every 6 h the server restarts with new pids."""
        if self.pattern != "reloads":
            return util
        if t >= self.reload_at:
            self.reload_at = t + 7200.0
            if self.rng.random() < 0.33:
                self.dev.pids = frozenset(self.rng.sample(range(1000, 60000), 2))
            self.memory = 1 * GB
            self.dev.errors[0] += int(self.rng.random() < 0.3)  # an application XID now and then
        if self.memory < self.dev.model_bytes:
            return 0.0
        return util

    def _memory(self, t: float, dt: float, util: float, kind: str) -> float:
        dev = self.dev
        if self.memory < dev.model_bytes:  # loading: a gigabyte a second
            self.memory = min(dev.model_bytes, self.memory + 1 * GB * dt)
        if kind == "memory_leak":
            self.leaked += self.leak_rate * dt
        cache = 0.0  # diurnal: a cache that grows with the day's traffic (not each sample's)
        if self.pattern == "diurnal":
            hour = (t / 3600.0) % 24
            cache = 0.15 * dev.memory_total * max(0.0, math.sin(2 * math.pi * (hour - 6) / 24))
        return min(dev.memory_total, self.memory + self.leaked + cache)

    @property
    def leak_rate(self) -> float:
        return 5e6 + 25e6 * random.Random(self.dev.limit).random()

    def _errors(self, t: float, dt: float, kind: str) -> None:
        errors, rng = self.dev.errors, self.rng
        if rng.random() < self.dev.ecc_rate * dt / 3600.0:
            errors[1] += 1
        if kind == "error_burst" and self.fault is not None:
            which, since = int(self.fault.start) % 3, t - self.fault.start
            every = (60.0, 10.0, 300.0)[which]  # XIDs (79, 48...), corrected ECC, uncorrectable
            if int((since + dt) / every) > int(since / every) or since < dt <= every:
                counter = (0, 1, 2 + int(rng.random() < 0.5))[which]
                errors[counter] += 1

    def _freeze(self, f: Features, kind: str) -> Features:
        if kind != "frozen_sensor":
            self.frozen = None
            return f
        self.frozen = self.frozen or f
        if int(self.fault.start if self.fault else 0) % 2:  # the whole driver hands back old values
            return self.frozen._replace(timestamp=f.timestamp, errors=f.errors)
        return f._replace(temperature=self.frozen.temperature)  # one dead thermal sensor


def run(sim: Sim, hours: float, dt: float, start_hour: float = 0.0) -> list[Features | None]:
    """The samples of `hours` of the simulation, dt seconds apart."""
    t0 = start_hour * 3600.0
    out: list[Features | None] = []
    for i in range(int(hours * 3600.0 / dt)):
        t = t0 + i * dt
        if sim.unforeseen == "reboot" and sim.fault is not None:
            if sim.fault.start <= t < sim.fault.start + 180.0:
                out.append(None)
                sim.dev.pids = frozenset({sim.rng.randint(1000, 60000)})
                sim.memory = 0.0
                continue
        out.append(sim.sample(t, dt))
    return out


def fault_trace(kind: str, pattern: str, seed: int, dt: float, hours: float = 8.0) -> Trace:
    """A trace with `kind` injected at a random busy time after a 4-hour warm-up."""
    rng = random.Random(seed * 31 + FAULTS.index(kind) * 7 + PATTERNS.index(pattern))
    start_hour = 6.0  # the traces begin at 06:00: idle_nights are busy 08:00 to 20:00
    start = (start_hour + 4.0 + rng.uniform(0, 2.0)) * 3600.0
    while not busy(pattern, start):
        start += 600.0
    duration = {"error_burst": 600.0, "frozen_sensor": 900.0}.get(kind, 1200.0)
    fault = Fault(kind, start, start + duration)
    sim = Sim(pattern, seed, fault)
    return Trace(f"{kind}/{pattern}/{seed}", pattern, seed, run(sim, hours, dt, start_hour), fault)


def clean_trace(pattern: str, seed: int, dt: float, hours: float = 24.0) -> Trace:
    """A day of the pattern with nothing wrong."""
    sim = Sim(pattern, seed, None)
    return Trace(f"clean/{pattern}/{seed}", pattern, seed, run(sim, hours, dt))


def unforeseen_trace(kind: str, pattern: str, seed: int, dt: float, hours: float = 12.0) -> Trace:
    """A fault no detector was written for: power creeping up a quarter over 12 hours from hour
    4, or the device rebooting (3 minutes gone, then back with new processes) at hour 6."""
    start = (4.0 if kind == "power_drift" else 6.0) * 3600.0
    end = hours * 3600.0 if kind == "power_drift" else start + 1800.0
    fault = Fault(kind, start, end)
    sim = Sim(pattern, seed, fault, unforeseen=kind)
    return Trace(f"{kind}/{pattern}/{seed}", pattern, seed, run(sim, hours, dt), fault)
