"""One counter made monotonic: how much a raw counter grew, a counter that never decreases
across resets and wrap-arounds, a new baseline, and the state rows of a device's counters."""

from __future__ import annotations

from typing import Any, Mapping

from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import number, optional_number, text


def increase(last: float | None, raw: float, wrap_at: float = 0.0) -> float:
    """How much a raw counter grew since `last` (0 on first sight).

    A drop is a wrap-around when the counter has a known range (`wrap_at`,
    e.g. RAPL's max_energy_range_uj), else a reset to zero.
    """
    if last is None:
        return 0.0
    if raw >= last:
        return raw - last
    return raw + (wrap_at - last if wrap_at > last else 0.0)


def rebased(last: dict[Any, float], now: Mapping[Any, float]) -> list[Any]:
    """Set each key of `last` read `now` to that reading, a new baseline (the counter is read by
    other means from now on); the keys set."""
    keys = [key for key in last if key in now]
    last.update((key, now[key]) for key in keys)
    return keys


class Monotonic:
    """Turns a raw counter that may reset (or wrap) into one that never decreases; starts at the
    first raw value."""

    __slots__ = ("last_raw", "value")

    def __init__(self) -> None:
        self.last_raw: float | None = None
        self.value = 0.0

    def update(self, raw: float, wrap_at: float = 0.0) -> float:
        self.value = (
            raw if self.last_raw is None else self.value + increase(self.last_raw, raw, wrap_at)
        )
        self.last_raw = raw
        return self.value

    @classmethod
    def of(cls, last_raw: float | None, value: float) -> Monotonic:
        """One in the state a saved one had."""
        state = cls()
        state.last_raw, state.value = last_raw, value
        return state


def monotonic_rows(devices: Mapping[str, Mapping[Any, Monotonic]]) -> list[list[Any]]:
    """[uuid, name, last raw value, value] of each counter of each device."""
    return [
        [uuid, name, state.last_raw, state.value]
        for uuid, counters in devices.items()
        for name, state in counters.items()
    ]


def monotonic_states(value: object, name: Any) -> dict[str, dict[Any, Monotonic]]:
    """The device counters of `monotonic_rows`' rows; `name` checks a counter's name."""
    devices: dict[str, dict[Any, Monotonic]] = {}
    for uuid, key, last_raw, current in carry.rows(value, text, name, optional_number, number):
        devices.setdefault(uuid, {})[key] = Monotonic.of(last_raw, current)
    return devices
