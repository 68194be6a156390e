"""Kepler-style energy attribution: node energy to processes, then containers and pods, as monotonic counters.

Pure (no I/O, no clock): the sampler calls ``Attribution.update`` once per
sample with the sources' readings. Per interval:

- CPU: node energy E is the increase of the package zones (psys, then core,
  where a node has no package zone), RAPL wrap-around handled. Active energy
  is E x usage, usage being busy / total CPU time of /proc/stat, and is shared
  by the CPU time each process used in the interval. Without RAPL, and only
  when configured, the estimate cpu_tdp_watts x usage x interval is all active.
- GPU: energy E is the increase of the device's energy counter, else power x
  interval. Idle energy is min(idle power, E / interval) x interval, the idle
  power being gpu_idle_watts or the lowest interval power seen on that GPU;
  with no process on the GPU the whole interval is idle. The active rest is
  shared by SM utilization, equally when the driver reports none, all to the
  only process (which covers NVML's exclusive-process compute mode). A device
  whose source cannot list processes keeps the idle part too; its active rest
  goes to the one container the kubelet assigned it to, else to the device's
  unattributed energy with reason ``shared`` (several owners) or ``no_owner``.
- Every level only ever adds increases, so no counter decreases; processes
  outside the top:N limit are summed into one ``pid="other"`` series.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from kepler_bridge.sampling.counters import increase
from kepler_bridge.model import (NO_POD, CpuTimes, CpuZoneEnergy, Energy, GpuProcess, GpuReading, Holder, PodRef,
                                 ProcessKey, RaplZone, WorkloadEnergy)
from kepler_bridge.sampling.top import TopCounter

# Zone kinds that measure the CPU as a whole, best first.
PRIMARY_ZONES = ("package", "psys", "core")
# A wrap-around implying more than this per zone is a counter reset instead.
MAX_ZONE_WATTS = 5000.0
# Why a device's active energy went to no container: several hold it, or none does.
UNATTRIBUTED_REASONS = ("no_owner", "shared")


@dataclass(frozen=True)
class Inputs:
    """One sample's readings as the sampler gathered them, with the Kubernetes owners it joined."""

    now: float  # monotonic seconds
    rapl_zones: tuple[RaplZone, ...] = ()
    cpu_times: CpuTimes | None = None
    gpus: tuple[GpuReading, ...] = ()  # node-wide, counters already monotonic, holders and process owners set
    cpu_increases: Mapping[ProcessKey, float] = field(default_factory=dict)
    owners: Mapping[ProcessKey, PodRef] = field(default_factory=dict)  # of cpu_increases' processes; NO_POD if absent


@dataclass
class _Tally:
    """Joules of one process, container or pod, and when it was last present."""

    labels: WorkloadEnergy
    seen: float
    cpu: float = 0.0
    gpu: float = 0.0

    @property
    def total(self) -> float:
        return self.cpu + self.gpu

    def row(self) -> WorkloadEnergy:
        return dataclasses.replace(self.labels, cpu_joules=self.cpu, gpu_joules=self.gpu)


def gpu_shares(processes: tuple[GpuProcess, ...]) -> list[float]:
    """Each process's share of a GPU's active energy: by SM utilization, equal when none is reported."""
    if len(processes) <= 1:
        return [1.0] * len(processes)
    utilization = [proc.utilization or 0.0 for proc in processes]
    total = sum(utilization)
    if total > 0:
        return [value / total for value in utilization]
    return [1.0 / len(processes)] * len(processes)


class Attribution:
    """Keeps the previous sample's counters and the accumulated joules of every level."""

    def __init__(self, *, cpu_tdp_watts: float = 0.0, gpu_idle_watts: float | None = None,
                 process_limit: int | None = 50, grace: float = 30.0, max_processes: int = 0) -> None:
        self._families: dict[str, TopCounter[WorkloadEnergy]] = {kind: TopCounter(process_limit)
                                                                  for kind in ("cpu", "gpu")}
        self.configure(cpu_tdp_watts=cpu_tdp_watts, gpu_idle_watts=gpu_idle_watts, process_limit=process_limit,
                       grace=grace, max_processes=max_processes)
        self._last_now: float | None = None
        self._last_cpu: CpuTimes | None = None
        self._last_uj: dict[str, int] = {}
        self._zones: dict[tuple[str, str], float] = {}
        self._last_gpu_joules: dict[str, float] = {}
        self._lowest_gpu_watts: dict[str, float] = {}
        self._gpu_idle: dict[str, float] = {}
        self._gpu_unattributed: dict[tuple[str, str], float] = {}
        self._processes: dict[ProcessKey, _Tally] = {}
        self._containers: dict[tuple[str, str, str, str], _Tally] = {}
        self._pods: dict[tuple[str, str], _Tally] = {}

    def configure(self, *, cpu_tdp_watts: float, gpu_idle_watts: float | None, process_limit: int | None,
                  grace: float, max_processes: int) -> None:
        """Set the settings; called again on reload, when the accumulated joules stay."""
        self.cpu_tdp_watts = cpu_tdp_watts
        self.gpu_idle_watts = gpu_idle_watts
        self.grace = grace
        self.max_processes = max_processes
        for family in self._families.values():
            family.limit = process_limit

    def update(self, inputs: Inputs) -> Energy:
        """Attribute the interval since the previous call and return every counter."""
        now = inputs.now
        seconds = now - self._last_now if self._last_now is not None else 0.0
        self._last_now = now
        usage, cpu_capacity = self._usage(inputs.cpu_times)
        increments: dict[ProcessKey, list[float]] = {}
        owners: dict[ProcessKey, PodRef] = {key: inputs.owners.get(key, NO_POD) for key in inputs.cpu_increases}
        self._share_cpu(self._cpu_active(inputs.rapl_zones, usage, seconds), inputs.cpu_increases, cpu_capacity,
                        increments)
        owned: dict[Holder, float] = {}
        for gpu in inputs.gpus:
            for proc in gpu.processes:
                key = proc.key
                if proc.owner != NO_POD or key not in owners:
                    owners[key] = proc.owner
            active = self._gpu_active(gpu, seconds) if gpu.up else None
            if active is None:
                continue
            for proc, share in zip(gpu.processes, gpu_shares(gpu.processes)):
                increments.setdefault(proc.key, [0.0, 0.0])[1] += active * share
            if not gpu.processes and not gpu.lists_processes:
                self._share_unlisted(gpu.uuid, active, gpu.holders, owned)
        self._accumulate(owners, increments, now)
        self._accumulate_owned(owned, now)
        self._expire(now, owners)
        return Energy(
            cpu_zones=tuple(CpuZoneEnergy(zone, source, joules)
                            for (zone, source), joules in sorted(self._zones.items())),
            gpu_idle=tuple(sorted(self._gpu_idle.items())),
            gpu_unattributed=tuple((uuid, reason, joules)
                                   for (uuid, reason), joules in sorted(self._gpu_unattributed.items())),
            cpu_processes=self._process_rows(increments, "cpu"),
            gpu_processes=self._process_rows(increments, "gpu"),
            containers=tuple(self._containers[key].row() for key in sorted(self._containers)),
            pods=tuple(self._pods[key].row() for key in sorted(self._pods)),
        )

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

    def _cpu_active(self, zones: tuple[RaplZone, ...], usage: float | None, seconds: float) -> float:
        """Active CPU joules of the interval; adds every zone's increase to the node counters."""
        by_kind: dict[str, float] = {}
        for zone in zones:
            last = self._last_uj.get(zone.id)
            self._last_uj[zone.id] = zone.energy_uj
            joules = increase(last, zone.energy_uj, zone.max_energy_range_uj) / 1e6
            if last is not None and zone.energy_uj < last and joules > MAX_ZONE_WATTS * max(seconds, 1.0):
                joules = zone.energy_uj / 1e6
            by_kind[zone.zone] = by_kind.get(zone.zone, 0.0) + joules
        for kind, joules in by_kind.items():
            self._zones[(kind, "rapl")] = self._zones.get((kind, "rapl"), 0.0) + joules
        if usage is None:
            return 0.0
        if zones:
            return usage * next((by_kind[kind] for kind in PRIMARY_ZONES if kind in by_kind), 0.0)
        if self.cpu_tdp_watts:
            joules = self.cpu_tdp_watts * usage * seconds
            self._zones[("package", "estimate")] = self._zones.get(("package", "estimate"), 0.0) + joules
            return joules
        return 0.0

    @staticmethod
    def _share_cpu(active: float, cpu_increases: Mapping[ProcessKey, float], capacity: float,
                   increments: dict[ProcessKey, list[float]]) -> None:
        # No process can use more than all CPUs for the whole interval; a larger increase is a process
        # seen again after it was dropped from the table, whose whole history arrives at once.
        used = {key: min(seconds, capacity) for key, seconds in cpu_increases.items() if seconds > 0}
        total = sum(used.values())
        if active <= 0 or total <= 0:
            return
        for key, seconds in used.items():
            increments.setdefault(key, [0.0, 0.0])[0] += active * (seconds / total)

    def _gpu_active(self, gpu: GpuReading, seconds: float) -> float | None:
        """Adds the interval's idle energy to the device's and returns the active rest; None when not known."""
        if gpu.energy_joules is not None:
            last = self._last_gpu_joules.get(gpu.uuid)
            self._last_gpu_joules[gpu.uuid] = gpu.energy_joules
            if last is None or seconds <= 0:
                return None
            joules = increase(last, gpu.energy_joules)
        elif gpu.power_watts is not None and seconds > 0:
            joules = gpu.power_watts * seconds
        else:
            return None
        lowest = self._lowest_gpu_watts[gpu.uuid] = min(self._lowest_gpu_watts.get(gpu.uuid, joules / seconds),
                                                        joules / seconds)
        idle_watts = lowest if self.gpu_idle_watts is None else self.gpu_idle_watts
        idle = min(idle_watts * seconds, joules) if gpu.processes or not gpu.lists_processes else joules
        self._gpu_idle[gpu.uuid] = self._gpu_idle.get(gpu.uuid, 0.0) + idle
        return joules - idle

    def _share_unlisted(self, uuid: str, active: float, holders: tuple[Holder, ...],
                        owned: dict[Holder, float]) -> None:
        """A device without process data: its active energy to its one owner, else unattributed with the reason."""
        for reason in UNATTRIBUTED_REASONS:
            self._gpu_unattributed.setdefault((uuid, reason), 0.0)
        if len(holders) == 1:
            owned[holders[0]] = owned.get(holders[0], 0.0) + active
        else:
            self._gpu_unattributed[(uuid, "shared" if holders else "no_owner")] += active

    def _accumulate(self, owners: Mapping[ProcessKey, PodRef], increments: Mapping[ProcessKey, list[float]],
                    now: float) -> None:
        for key, owner in owners.items():
            pid, comm, container_id = key
            process = self._processes.get(key)
            if process is None or process.labels.owner != owner:
                labels = WorkloadEnergy(str(pid), comm, container_id, owner)
                process = self._processes.setdefault(key, _Tally(labels, now))
                process.labels = labels
            cpu, gpu = increments.get(key, (0.0, 0.0))
            for tally in (process, *self._levels(container_id, owner, now)):
                tally.seen = now
                tally.cpu += cpu
                tally.gpu += gpu

    def _accumulate_owned(self, owned: Mapping[Holder, float], now: float) -> None:
        """Adds device energy booked to its holder to that container and its pod."""
        for holder, joules in owned.items():
            for tally in self._levels(holder.container_id, holder.owner, now):
                tally.seen = now
                tally.gpu += joules

    def _levels(self, container_id: str, owner: PodRef, now: float) -> tuple[_Tally, _Tally]:
        """The tallies of a container and of its pod, made on first use."""
        container_key = (container_id, owner.namespace, owner.pod, owner.container)
        pod_key = (owner.namespace, owner.pod)
        if container_key not in self._containers:
            self._containers[container_key] = _Tally(WorkloadEnergy(container_id=container_id, owner=owner), now)
        if pod_key not in self._pods:
            self._pods[pod_key] = _Tally(WorkloadEnergy(owner=PodRef(*pod_key)), now)
        return self._containers[container_key], self._pods[pod_key]

    def _expire(self, now: float, present: Mapping[ProcessKey, PodRef]) -> None:
        for tallies in (self._processes, self._containers, self._pods):
            for key in [key for key, tally in tallies.items() if now - tally.seen > self.grace]:
                del tallies[key]
        excess = len(self._processes) - self.max_processes
        if self.max_processes > 0 and excess > 0:
            absent = sorted((key for key in self._processes if key not in present),
                            key=lambda key: self._processes[key].total)
            for key in absent[:excess]:
                del self._processes[key]

    def _process_rows(self, increments: Mapping[ProcessKey, list[float]],
                      kind: str) -> tuple[WorkloadEnergy, ...]:
        """One kind's per-process rows: the top N by that kind's joules, plus pid="other" once any is left out.

        A shown series counts from the sample its process entered the top N
        (what it used before went to "other"), so the series' increases always
        add up to the node's attributed energy and none ever decreases.
        """
        family, position, field_name = self._families[kind], ("cpu", "gpu").index(kind), f"{kind}_joules"
        totals = {tally.labels: getattr(tally, kind) for tally in self._processes.values()}
        gained = {self._processes[key].labels: joules[position] for key, joules in increments.items()}
        rows = [dataclasses.replace(labels, **{field_name: joules}) for labels, joules in family.update(totals, gained)]
        if family.other is not None:
            rows.append(WorkloadEnergy(pid="other", **{field_name: family.other}))
        return tuple(rows)
