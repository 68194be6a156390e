"""Node CPU energy per interval: the RAPL zones' increases, and the active part shared by CPU time.

Node energy E is the increase of the package zones (psys, then core, where a
node has no package zone), RAPL wrap-around handled. Active energy is
E x usage, usage being busy / total CPU time of /proc/stat, and is shared by
the CPU time each process used in the interval. Without RAPL, and only when
configured, the estimate cpu_tdp_watts x usage x interval is all active.
"""

from __future__ import annotations

from itertools import compress
from typing import Any, Mapping

from kepler_bridge.model import CpuTimes, CpuZoneEnergy, ProcessLabels, RaplZone
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import integer, number, text
from kepler_bridge.sampling.monotonic import increase

# Zone kinds that measure the CPU as a whole, best first.
PRIMARY_ZONES = ("package", "psys", "core")
# A wrap-around implying more than this per zone is a counter reset instead.
MAX_ZONE_WATTS = 5000.0


class CpuEnergy:
    """The previous sample's RAPL counters and CPU times, and the node's joules per zone kind."""

    def __init__(self, tdp_watts: float = 0.0) -> None:
        self.configure(tdp_watts)
        self._last_cpu: CpuTimes | None = None
        self._last_uj: dict[str, int] = {}
        self._zones: dict[
            tuple[str, str], float
        ] = {}  # (zone kind, "rapl" or "estimate") -> joules

    def configure(self, tdp_watts: float) -> None:
        """Set --cpu-tdp-watts; called again on reload."""
        self.tdp_watts = tdp_watts

    def active(
        self, zones: tuple[RaplZone, ...], times: CpuTimes | None, seconds: float
    ) -> tuple[float, float]:
        """Active CPU joules of the interval and the CPU seconds all CPUs had in it.

        Adds every zone's increase to the node counters.
        """
        usage, capacity = self._usage(times)
        return self._active(zones, usage, seconds), capacity

    def zones(self) -> tuple[CpuZoneEnergy, ...]:
        """The node's joules per zone kind and source since the start."""
        return tuple(
            CpuZoneEnergy(zone, source, joules)
            for (zone, source), joules in sorted(self._zones.items())
        )

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`; `restore` takes it back."""
        last = self._last_cpu
        return {
            "last_cpu": None if last is None else [last.busy_seconds, last.total_seconds],
            "last_uj": list(map(list, self._last_uj.items())),
            "zones": [[*key, joules] for key, joules in self._zones.items()],
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        last = carry.field(state, "last_cpu")
        self._last_cpu = None if last is None else CpuTimes(*carry.rows([last], number, number)[0])
        self._last_uj = dict(carry.rows(carry.field(state, "last_uj"), text, integer))
        found = carry.rows(carry.field(state, "zones"), text, text, number)
        self._zones = {(zone, source): joules for zone, source, joules in found}

    def _usage(self, times: CpuTimes | None) -> tuple[float | None, float]:
        """The node's CPU usage ratio over the interval and the CPU seconds all CPUs had in it."""
        if times is None:
            return None, 0.0
        last, self._last_cpu = self._last_cpu, times
        if last is None:
            return None, 0.0
        total = times.total_seconds - last.total_seconds
        busy = times.busy_seconds - last.busy_seconds
        if total <= 0 or busy < 0:
            return None, 0.0
        return min(1.0, busy / total), total

    def _active(self, zones: tuple[RaplZone, ...], usage: float | None, seconds: float) -> float:
        """Active CPU joules of the interval; adds every zone's increase to the node counters."""
        by_kind = self._increases(zones, seconds)
        for kind, joules in by_kind.items():
            self._zones[(kind, "rapl")] = self._zones.get((kind, "rapl"), 0.0) + joules
        if usage is None:
            return 0.0
        if zones:
            return usage * next((by_kind[kind] for kind in PRIMARY_ZONES if kind in by_kind), 0.0)
        if self.tdp_watts:
            joules = self.tdp_watts * usage * seconds
            self._zones[("package", "estimate")] = (
                self._zones.get(("package", "estimate"), 0.0) + joules
            )
            return joules
        return 0.0

    def _increases(self, zones: tuple[RaplZone, ...], seconds: float) -> dict[str, float]:
        """Joules per zone kind since the previous sample, wrap-around and resets handled."""
        by_kind: dict[str, float] = {}
        for zone in zones:
            last = self._last_uj.get(zone.id)
            self._last_uj[zone.id] = zone.energy_uj
            joules = increase(last, zone.energy_uj, zone.max_energy_range_uj) / 1e6
            if (
                last is not None
                and zone.energy_uj < last
                and joules > MAX_ZONE_WATTS * max(seconds, 1.0)
            ):
                joules = zone.energy_uj / 1e6
            by_kind[zone.zone] = by_kind.get(zone.zone, 0.0) + joules
        return by_kind


def share_cpu(
    active: float, cpu_increases: Mapping[ProcessLabels, float], capacity: float
) -> dict[ProcessLabels, float]:
    """Each process's part of the active CPU joules, by the CPU seconds it used in the interval."""
    # No process can use more than all CPUs for the whole interval; a larger increase is a process
    # seen again after it was dropped from the table, whose whole history arrives at once.
    ran = compress(cpu_increases.items(), cpu_increases.values())  # in C: most did not run
    used = {key: min(seconds, capacity) for key, seconds in ran if seconds > 0}
    total = sum(used.values())
    if active <= 0 or total <= 0:
        return {}
    return {key: active * (seconds / total) for key, seconds in used.items()}
