"""Physical-range checks: a reading outside them is a driver sentinel or garbage, and is dropped."""

from __future__ import annotations

from kepler_bridge.model import MAX_EXACT

MAX_WATTS = 5_000.0
MIN_CELSIUS, MAX_CELSIUS = -55.0, 150.0  # edge boards run below freezing (Jetson Orin: -25)
MAX_HERTZ = 10e9
MAX_BYTES = MAX_EXACT
MAX_BYTES_PER_SECOND = 1e12


def bounded(value: float | None, low: float, high: float) -> float | None:
    """The value when low <= value <= high, else None; an int as a float, as the sanitiser would
    make it (most NVML readings are ints), so the reading passes it as it is."""
    if value is None or not low <= value <= high:
        return None
    return float(value) if type(value) is int else value


def ratio_from_percent(percent: float | None) -> float | None:
    """0..100 % as a 0..1 ratio; anything else dropped."""
    checked = bounded(percent, 0, 100)
    return None if checked is None else checked / 100.0


def fan_ratio_from_percent(percent: float | None) -> float | None:
    """A fan's 0..200 % as a ratio: NVML's percent of the fan's noise-tolerance maximum "may
    exceed 100 %"; sentinels dropped."""
    checked = bounded(percent, 0, 200)
    return None if checked is None else checked / 100.0


def celsius(value: float | None) -> float | None:
    """Temperatures from -55 to 150 °C; sentinels (Jetson's -256 °C) dropped."""
    return bounded(value, MIN_CELSIUS, MAX_CELSIUS)


def watts(value: float | None) -> float | None:
    """Power from 0 to 5 kW."""
    return bounded(value, 0, MAX_WATTS)


def hertz(value: float | None) -> float | None:
    """Clocks from just above 0 to 10 GHz."""
    return bounded(value, 1, MAX_HERTZ)


def free_bytes(total: int | None, used: int | None) -> int | None:
    """Free memory as total − used, where both are known and used fits in total."""
    if total is None or used is None or used > total:
        return None
    return total - used


def byte_count(value: float | None) -> int | None:
    """Byte quantities (memory, counters of bytes) below 2**53, as whole numbers."""
    return None if value is None or not 0 <= value < MAX_BYTES else int(value)


def ratio(value: float | None) -> float | None:
    """Fractions from 0 to 1 (utilization, fan speed)."""
    return bounded(value, 0, 1)


def joules(value: float | None) -> float | None:
    """Energy counters below 2**53 J; beyond that is a sentinel, not energy."""
    return None if value is None or not 0 <= value < MAX_EXACT else value
