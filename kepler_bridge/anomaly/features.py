"""What the detectors and the model read of one device in one sample."""

from __future__ import annotations

from typing import NamedTuple

from kepler_bridge.model import GpuReading

# Clock-event reasons that hold clocks down against the work asked for (not idle, not a setting);
# the power cap apart: a board at its power limit is doing what it was set to do.
POWER_CAP = "sw_power_cap"
MIN_LIMIT_WATTS = 1.0
# XIDs NVIDIA documents as an application's own fault, or its process killed: 13 graphics engine
# exception, 31 MMU fault, 43 GPU stopped processing, 45 preemptive cleanup. A crash-looping pod
# makes a few a minute on healthy hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
SLOWDOWNS = frozenset(
    {
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)


class Features(NamedTuple):
    """One device in one sample; None where the device cannot report it."""

    timestamp: float
    utilization: float | None
    memory_used: float | None
    memory_total: float | None
    temperature: float | None
    power: float | None
    power_limit: float | None
    sm_clock: float | None
    memory_clock: float | None
    fan: float | None
    throttled: bool  # a slowdown other than the power cap is active
    # XID events, corrected ECC, uncorrected ECC, remapped rows; None where the device did not say
    errors: tuple[int, int | None, int | None, int | None]
    processes: frozenset[int] | None  # None where the source cannot list them
    power_capped: bool = False  # the power cap holds the clocks down


def of(gpu: GpuReading, timestamp: float) -> Features:
    """The features of an up device's reading."""
    correctable, uncorrectable = gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable
    remapped = None if correctable is None or uncorrectable is None else correctable + uncorrectable
    return Features(
        timestamp,
        gpu.utilization,
        _float(gpu.memory_used_bytes),
        _float(gpu.memory_total_bytes),
        gpu.temperature_celsius,
        gpu.power_watts,
        _limit(gpu.power_limit_watts),
        gpu.sm_clock_hertz,
        gpu.memory_clock_hertz,
        gpu.fan_speed_ratio,
        any(active for reason, active in gpu.throttled if reason in SLOWDOWNS),
        (
            sum(count for code, count in gpu.xid_errors if code not in APPLICATION_XIDS),
            gpu.ecc_corrected_total,
            gpu.ecc_uncorrected_total,
            remapped,
        ),
        frozenset(p.pid for p in gpu.processes) if gpu.lists_processes else None,
        any(active for reason, active in gpu.throttled if reason == POWER_CAP),
    )


def _limit(watts: float | None) -> float | None:
    """A power limit the detectors divide by: none below MIN_LIMIT_WATTS, which no accelerator
    has (a tiny one made the ratio infinite)."""
    return None if watts is None or watts < MIN_LIMIT_WATTS else watts


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


def vector(now: Features, before: Features | None) -> list[float] | None:
    """The model's input for one sample (values scaled to their device's range, then their rates
    per minute since `before`); None where a field is missing."""
    values = _scaled(now)
    if values is None:
        return None
    old = _scaled(before) if before is not None else None
    elapsed = now.timestamp - before.timestamp if before is not None else 0.0
    if old is None or elapsed <= 0:
        return values + [0.0] * len(values)
    return values + [(a - b) / elapsed * 60.0 for a, b in zip(values, old)]


def _scaled(f: Features) -> list[float] | None:
    """Values of comparable size: ratios, memory over total, watts over the limit, GHz, °C/100."""
    if f.utilization is None or f.temperature is None or f.power is None:
        return None
    memory = f.memory_used / f.memory_total if f.memory_used is not None and f.memory_total else 0.0
    power = f.power / f.power_limit if f.power_limit else f.power / 1000.0
    # Two relations the physics holds, which a fault breaks and axis-parallel splits see only
    # as such: work against power (stuck work), heat against power (cooling).
    return [
        f.utilization,
        memory,
        f.temperature / 100.0,
        power,
        (f.sm_clock or 0.0) / 1e9,
        (f.memory_clock or 0.0) / 1e9,
        f.utilization - power,
        f.temperature / 100.0 - power,
    ]
