"""Keeps exported counters monotonic across device resets, lost GPUs and process churn."""

from __future__ import annotations

import dataclasses

from kepler_bridge.model import GpuReading, ProcessCpu


class _Monotonic:
    """Turns a raw counter that may reset to zero into one that never decreases."""

    __slots__ = ("last_raw", "offset")

    def __init__(self) -> None:
        self.last_raw: float | None = None
        self.offset = 0.0

    def update(self, raw: float) -> float:
        if self.last_raw is not None and raw < self.last_raw:
            self.offset += self.last_raw
        self.last_raw = raw
        return raw + self.offset


class CounterGuard:
    """Per-device and per-container counter state owned by the sampler thread."""

    def __init__(self) -> None:
        self._gpu: dict[tuple[str, str], _Monotonic] = {}
        self._process_seen: dict[tuple[int, str], float] = {}
        self._container_total: dict[str, float] = {}

    def _value(self, uuid: str, name: str, raw: float) -> float:
        state = self._gpu.get((uuid, name))
        if state is None:
            state = self._gpu[(uuid, name)] = _Monotonic()
        return state.update(raw)

    def gpu(self, reading: GpuReading) -> GpuReading:
        """Return the reading with its counters made monotonic per device uuid."""
        if not reading.up:
            return reading
        changes: dict[str, object] = {}
        for name in ("energy_joules", "ecc_corrected_total", "ecc_uncorrected_total"):
            raw = getattr(reading, name)
            if raw is not None:
                value = self._value(reading.uuid, name, raw)
                changes[name] = type(raw)(value)
        if reading.xid_errors:
            changes["xid_errors"] = tuple(
                (xid, int(self._value(reading.uuid, f"xid{xid}", count))) for xid, count in reading.xid_errors)
        return dataclasses.replace(reading, **changes) if changes else reading

    def containers(self, processes: list[ProcessCpu]) -> tuple[tuple[str, float], ...]:
        """Per-container CPU seconds as sums of process deltas, so a process leaving never lowers a total."""
        seen: dict[tuple[int, str], float] = {}
        present: set[str] = set()
        for proc in processes:
            if not proc.container_id:
                continue
            key = (proc.pid, proc.container_id)
            last = self._process_seen.get(key, 0.0)
            delta = proc.cpu_seconds - last if proc.cpu_seconds >= last else proc.cpu_seconds
            self._container_total[proc.container_id] = self._container_total.get(proc.container_id, 0.0) + delta
            seen[key] = proc.cpu_seconds
            present.add(proc.container_id)
        self._process_seen = seen
        for container in set(self._container_total) - present:
            del self._container_total[container]
        return tuple(sorted(self._container_total.items()))
