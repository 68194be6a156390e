"""GPU energy per interval: the idle part stays with the device, the active rest goes to its users.

A GPU's energy E is the increase of its energy counter, else power x
interval. Idle energy is min(idle power, E / interval) x interval, the idle
power being gpu_idle_watts or the lowest interval power seen on that GPU;
with no process on the GPU the whole interval is idle. The active rest is
shared by SM utilization, equally when the driver reports none, all to the
only process (which covers NVML's exclusive-process compute mode). A device
whose source cannot list processes keeps the idle part too; its active rest
goes to the one container the kubelet assigned it to, else to the device's
unattributed energy with reason ``shared`` (several owners) or ``no_owner``.

A GPU in MIG mode reports no per-process utilization. Its active energy is
split over its GPU instances that have processes by the SMs each kept busy:
its GPM SM activity (nvmlGpmMigSampleGet, a fraction of its own SMs) times
its compute slices, so a 3g instance half busy weighs 1.5 times a 1g one
fully busy. Where GPM reports no activity for one of them, or none of them
is active, the weight is the compute slices alone (a 3g instance weighs three
times a 1g one); equal where slices are unknown. Within a GPU instance the
share goes over its processes by device memory used, equally where memory
is unknown. Processes the MIG devices do not list get nothing; when none
lists any, the rule above applies.
"""

from __future__ import annotations

from typing import Any, Iterable

from kepler_bridge.model import (
    GpuProcess,
    GpuReading,
    Holder,
    MigInstance,
    ProcessLabels,
    process_labels,
)
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import number, text
from kepler_bridge.sampling.monotonic import increase

# Why a device's active energy went to no container: several hold it, or none does.
UNATTRIBUTED_REASONS = ("no_owner", "shared")


def gpu_shares(processes: tuple[GpuProcess, ...]) -> list[float]:
    """Each process's share of a GPU's active energy: by SM utilization, else equal."""
    if len(processes) <= 1:
        return [1.0] * len(processes)
    utilization = [proc.utilization or 0.0 for proc in processes]
    total = sum(utilization)
    if total > 0:
        return [value / total for value in utilization]
    return [1.0 / len(processes)] * len(processes)


def mig_shares(gpu: GpuReading) -> list[float] | None:
    """Each process's share of a MIG GPU's active energy, in `gpu.processes` order (module note);
    None when no process of the GPU runs in one of its MIG devices."""
    by_pid = {proc.pid: proc for proc in gpu.processes}
    members: dict[int, set[int]] = {}  # GPU instance id -> pids
    for instance in gpu.mig_instances:
        pids = members.setdefault(instance.gpu_instance, set())
        pids.update(pid for pid in instance.pids if pid in by_pid)
    busy = {gi: sorted(found) for gi, found in members.items() if found}
    if not busy:
        return None
    weights = instance_weights(gpu.mig_instances, busy)
    shares: dict[int, float] = {}
    for gi, members_pids in busy.items():
        for pid, part in zip(members_pids, _by_memory([by_pid[pid] for pid in members_pids])):
            shares[pid] = shares.get(pid, 0.0) + weights[gi] * part
    return [shares.get(proc.pid, 0.0) for proc in gpu.processes]


def instance_weights(instances: tuple[MigInstance, ...], busy: Iterable[int]) -> dict[int, float]:
    """Each busy GPU instance's share of the GPU: by SMs in use (SM active x slices) where GPM
    reports every one's activity, else by compute slices; equal where any slices are unknown."""
    by_id = {instance.gpu_instance: instance for instance in instances}
    chosen = {gpu_instance: by_id.get(gpu_instance) for gpu_instance in busy}
    slices = {gi: instance.slices if instance else None for gi, instance in chosen.items()}
    if any(not count for count in slices.values()):
        return {gpu_instance: 1.0 / len(chosen) for gpu_instance in chosen}
    active = [instance.sm_active if instance else None for instance in chosen.values()]
    if None not in active:
        in_use = {
            gi: (slices[gi] or 0) * (instance.sm_active or 0.0)
            for gi, instance in chosen.items()
            if instance
        }
        if sum(in_use.values()) > 0:
            return _normalized(in_use)
    return _normalized({gi: float(count or 0) for gi, count in slices.items()})


def _normalized(weights: dict[int, float]) -> dict[int, float]:
    """The weights scaled to sum to 1 (their sum is positive)."""
    total = sum(weights.values())
    return {key: value / total for key, value in weights.items()}


def _by_memory(processes: list[GpuProcess]) -> list[float]:
    """Shares by device memory used; equal when any is unknown or all are zero."""
    memory = [proc.memory_used_bytes for proc in processes]
    total = sum(used or 0 for used in memory)
    if None in memory or total <= 0:
        return [1.0 / len(processes)] * len(processes)
    return [(used or 0) / total for used in memory]


class GpuEnergy:
    """Per device: last energy counter, lowest interval power, idle and unattributed joules."""

    def __init__(self, idle_watts: float | None = None) -> None:
        self.configure(idle_watts)
        self._last_joules: dict[str, float] = {}
        self._by_power: set[str] = set()  # whose last interval was booked by power
        self._lowest_watts: dict[str, float] = {}
        self._idle: dict[str, float] = {}
        self._unattributed: dict[tuple[str, str], float] = {}  # (uuid, reason) -> joules

    def configure(self, idle_watts: float | None) -> None:
        """Set --gpu-idle-watts (None: the lowest power seen); called again on reload."""
        self.idle_watts = idle_watts

    def forget(self, uuids: set[str]) -> None:
        """Drop what is kept of devices gone for good; their series end."""
        self._by_power -= uuids
        for uuid in uuids:
            self._last_joules.pop(uuid, None)
            self._lowest_watts.pop(uuid, None)
            self._idle.pop(uuid, None)
        for key in [key for key in self._unattributed if key[0] in uuids]:
            del self._unattributed[key]

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`; `restore` takes it back."""
        return {
            "last_joules": list(map(list, self._last_joules.items())),
            "lowest_watts": list(map(list, self._lowest_watts.items())),
            "idle": list(map(list, self._idle.items())),
            "unattributed": [[*key, joules] for key, joules in self._unattributed.items()],
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        self._last_joules = _by_uuid(carry.field(state, "last_joules"))
        self._lowest_watts = _by_uuid(carry.field(state, "lowest_watts"))
        self._idle = _by_uuid(carry.field(state, "idle"))
        found = carry.rows(carry.field(state, "unattributed"), text, text, number)
        if any(reason not in UNATTRIBUTED_REASONS for _, reason, _ in found):
            raise carry.BadState("unknown reason of unattributed energy")
        self._unattributed = {(uuid, reason): joules for uuid, reason, joules in found}

    def share(
        self, gpus: Iterable[GpuReading], seconds: float
    ) -> tuple[dict[ProcessLabels, float], dict[Holder, float]]:
        """The active GPU joules per process, and per holder of a device that lists none."""
        processes: dict[ProcessLabels, float] = {}
        owned: dict[Holder, float] = {}
        for gpu in gpus:
            active = self._active(gpu, seconds) if gpu.up else None
            if active is None:
                continue
            shares = mig_shares(gpu) if gpu.mig_instances else None
            keys = map(process_labels, gpu.processes)
            for key, share in zip(keys, shares or gpu_shares(gpu.processes)):
                processes[key] = processes.get(key, 0.0) + active * share
            if not gpu.processes and not gpu.lists_processes:
                self._share_unlisted(gpu.uuid, active, gpu.holders, owned)
        return processes, owned

    def idle(self) -> tuple[tuple[str, float], ...]:
        """Each device's idle joules since the start, by uuid."""
        return tuple(sorted(self._idle.items()))

    def unattributed(self) -> tuple[tuple[str, str, float], ...]:
        """Each device's joules that went to no container, by uuid and reason."""
        return tuple(
            (uuid, reason, joules) for (uuid, reason), joules in sorted(self._unattributed.items())
        )

    def _active(self, gpu: GpuReading, seconds: float) -> float | None:
        """Books the interval's idle energy on the device; the active rest, None when unknown."""
        joules = self._joules(gpu, seconds)
        if joules is None:
            return None
        lowest = self._lowest_watts[gpu.uuid] = min(
            self._lowest_watts.get(gpu.uuid, joules / seconds), joules / seconds
        )
        idle_watts = lowest if self.idle_watts is None else self.idle_watts
        idle = (
            min(idle_watts * seconds, joules)
            if gpu.processes or not gpu.lists_processes
            else joules
        )
        self._idle[gpu.uuid] = self._idle.get(gpu.uuid, 0.0) + idle
        return joules - idle

    def _joules(self, gpu: GpuReading, seconds: float) -> float | None:
        """The device's joules in the interval: the energy counter's increase, else power times
        the interval. Intervals booked by power leave the counter no start (not even in a saved
        state): back, its first interval is booked by power too, not the gap again."""
        uuid = gpu.uuid
        if gpu.energy_joules is None:
            if gpu.power_watts is None or seconds <= 0:
                return None
            self._last_joules.pop(uuid, None)
            self._by_power.add(uuid)
            return gpu.power_watts * seconds
        last = self._last_joules.get(uuid)
        self._last_joules[uuid] = gpu.energy_joules
        if seconds <= 0:
            return None
        if uuid in self._by_power:
            self._by_power.discard(uuid)
            return None if gpu.power_watts is None else gpu.power_watts * seconds
        return None if last is None else increase(last, gpu.energy_joules)

    def _share_unlisted(
        self, uuid: str, active: float, holders: tuple[Holder, ...], owned: dict[Holder, float]
    ) -> None:
        """A device without process data: its active energy to its one owner, else unattributed."""
        for reason in UNATTRIBUTED_REASONS:
            self._unattributed.setdefault((uuid, reason), 0.0)
        if len(holders) == 1:
            owned[holders[0]] = owned.get(holders[0], 0.0) + active
        else:
            self._unattributed[(uuid, "shared" if holders else "no_owner")] += active


def _by_uuid(value: object) -> dict[str, float]:
    """Rows [uuid, value] of a saved state as a mapping."""
    return dict(carry.rows(value, text, number))
