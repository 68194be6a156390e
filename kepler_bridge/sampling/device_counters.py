"""The counters of each device (energy, errors, NVLink bytes, XIDs...) made monotonic across
resets and wrap-arounds, with their carried state."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Iterable, TypeVar

from kepler_bridge.model import GpuReading, NvLink, replaced
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import code, text
from kepler_bridge.sampling.monotonic import Monotonic, increase, monotonic_rows, monotonic_states
from kepler_bridge.sources.ranges import MAX_WATTS

Number = TypeVar("Number", int, float)
ENERGY = "energy_joules"
# The device counters a source reads seldom (the nvml source every --nvml-counter-interval), so
# most samples bring them unchanged; clock_event_seconds, a tuple of named counters, comes last.
_SLOW_NAMES = (
    "ecc_corrected_total",
    "ecc_uncorrected_total",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "retired_pages_single_bit",
    "retired_pages_double_bit",
    "pcie_replays",
)
_SLOW = attrgetter(*_SLOW_NAMES, "clock_event_seconds")


class DeviceCounters:
    """The monotonic counters of every device, by uuid; owned by the sampler thread."""

    def __init__(self) -> None:
        self._gpu: dict[str, dict[str, Monotonic]] = {}  # uuid -> counter name -> state
        # uuid -> the slow counters' raw values of its last reading and the values made of them
        self._slow: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._xid: dict[str, dict[int | str, Monotonic]] = {}
        self._energy_at: dict[str, float] = {}  # uuid -> when its energy was last read
        # [uuid, counter name, last raw value, value] of each device counter.
        self._rows = carry.Table(carry.own_cells, self._numbers)

    def forget(self, uuids: Iterable[str]) -> None:
        """Drop the counters of devices gone for good: if one comes back, they start again."""
        for uuid in uuids:
            self._rows.removed((uuid, name) for name in self._gpu.get(uuid, ()))
            self._gpu.pop(uuid, None)
            self._slow.pop(uuid, None)
            self._xid.pop(uuid, None)
            self._energy_at.pop(uuid, None)

    def _value(self, uuid: str, name: str, raw: float) -> float:
        device = self._gpu.get(uuid)
        if device is None:
            device = self._gpu[uuid] = {}
        state = device.get(name)
        if state is None:
            state = device[name] = Monotonic()
        if state.last_raw != raw:
            self._rows.changed(((uuid, name),))
        return state.update(raw)

    def gpu(self, reading: GpuReading, now: float) -> GpuReading:
        """Return the reading with its counters made monotonic per device uuid; `now`: when it
        was read (monotonic clock seconds)."""
        if not reading.up:
            return reading
        uuid, xids = reading.uuid, reading.xid_errors
        return replaced(
            reading,
            energy_joules=self._energy(uuid, reading.energy_joules, now),
            xid_errors=self._xids(uuid, xids) if xids else xids,
            nvlinks=tuple(self._nvlink(uuid, link) for link in reading.nvlinks),
            **self._slow_counters(reading),
        )

    def _energy(self, uuid: str, raw: float | None, now: float) -> float | None:
        """The energy counter made monotonic, where it grew as a board can: a read more than
        MAX_WATTS above the last in the time between (garbage, or the first good one after a bad
        read taken for a reset) is the new baseline and adds nothing."""
        last_at, self._energy_at[uuid] = self._energy_at.get(uuid), now
        state = self._gpu.get(uuid, {}).get(ENERGY)
        if raw is not None and state is not None and state.last_raw is not None:
            if last_at is not None and increase(state.last_raw, raw) > MAX_WATTS * (now - last_at):
                state.last_raw = raw
                self._rows.changed(((uuid, ENERGY),))
                return state.value
        return self._counter(uuid, ENERGY, raw)

    def _slow_counters(self, reading: GpuReading) -> dict[str, Any]:
        """The reading's slow counters made monotonic; where their raw values are those of the
        device's last reading, the values made then (a counter that kept its raw value keeps
        its value)."""
        uuid, raw = reading.uuid, _SLOW(reading)
        last = self._slow.get(uuid)
        if last is not None and last[0] == raw:
            return last[1]
        made: dict[str, Any] = {
            name: self._counter(uuid, name, value) for name, value in zip(_SLOW_NAMES, raw)
        }
        made["clock_event_seconds"] = self._named(uuid, "clock_event", raw[-1])
        self._slow[uuid] = (raw, made)
        return made

    def _nvlink(self, uuid: str, link: NvLink) -> NvLink:
        name = f"nvlink{link.link}"
        return replaced(
            link,
            transmit_bytes=self._counter(uuid, f"{name}_transmit", link.transmit_bytes),
            receive_bytes=self._counter(uuid, f"{name}_receive", link.receive_bytes),
            errors=self._named(uuid, f"{name}_errors", link.errors),
        )

    def _named(
        self, uuid: str, prefix: str, counts: tuple[tuple[str, Number], ...]
    ) -> tuple[tuple[str, Number], ...]:
        """Counters labelled by name (a reason, an error kind), each made monotonic."""
        return tuple(
            (name, type(raw)(self._value(uuid, f"{prefix}:{name}", raw))) for name, raw in counts
        )

    def _counter(self, uuid: str, name: str, raw: Number | None) -> Number | None:
        """The monotonic value of one device counter, in the raw value's own type."""
        return None if raw is None else type(raw)(self._value(uuid, name, raw))

    def _xids(
        self, uuid: str, counts: tuple[tuple[int | str, int], ...]
    ) -> tuple[tuple[int | str, int], ...]:
        """XID counts made monotonic per code. A code the source stopped listing (its count moved
        to "other") is forgotten, so if it comes back its series starts again instead of counting
        its old errors twice."""
        known = self._xid.get(uuid, {})
        states = self._xid[uuid] = {code: known.get(code) or Monotonic() for code, _ in counts}
        return tuple((code, int(states[code].update(count))) for code, count in counts)

    def _numbers(self, keys: list[tuple[str, str]]) -> list[tuple[float | None, float]]:
        """Each counter's last raw value (never None: updated when it was made) and value."""
        states = [self._gpu[uuid][name] for uuid, name in keys]
        return [(state.last_raw, state.value) for state in states]

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`, in the counters' state; `restore` takes it back."""
        return {"gpu": self._rows, "xid": monotonic_rows(self._xid)}

    def restore(self, state: object) -> None:
        """Take the counters' state a previous worker saved; raises carry.BadState."""
        self._gpu = monotonic_states(carry.field(state, "gpu"), text)
        self._slow.clear()
        if any(
            counter.last_raw is None for device in self._gpu.values() for counter in device.values()
        ):
            raise carry.BadState("a device counter without its last raw value")
        self._rows.clear()
        self._rows.changed((uuid, name) for uuid, device in self._gpu.items() for name in device)
        self._xid = monotonic_states(carry.field(state, "xid"), code)
