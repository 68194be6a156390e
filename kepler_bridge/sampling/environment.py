"""Devices learned from the environment of each container's processes, where the kubelet's
pod-resources gives no answer (KubeEdge's EdgeCore serves no such socket).

Each container of the pod list is read once, from the environ of its lowest
pid, and its result kept until it leaves the sample; at most MAX_READS
containers are read in one sample, at most MAX_ENVIRON_BYTES of each environ.
A pid that cannot be read (gone, hidden, caught in exec, not the container's
any more) counts as a try, and the next sample tries another; after MAX_TRIES
tries the container counts as holding nothing.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Callable, Iterable, Mapping, Sequence

from kepler_bridge.kube.view import KubeView
from kepler_bridge.kube.visible_devices import NO_DEVICES, VisibleDevices, named, parse_environ
from kepler_bridge.model import ENVIRONMENT, GpuReading, Holder, ProcessLabels
from kepler_bridge.sources.cgroup import container_id, read_container_id

# The kubelet puts the device plugin's variables after a variable per service of the namespace:
# a megabyte holds ~4000 services; Linux caps argv and environ together at a quarter of the stack
# limit (2 MiB with the usual 8 MiB).
MAX_ENVIRON_BYTES = 1 << 20
MAX_READS = 8
MAX_TRIES = 3
_IDENTITY = attrgetter("vendor", "uuid", "index", "mig_uuids", "device_ids")


class EnvironmentDevices:
    """Which container holds which device by its environment; `view` adds that to a KubeView."""

    def __init__(
        self, procfs: str, container_of: Callable[[int], str | None] | None = None
    ) -> None:
        """`container_of`: a live pid's container id (its cgroup), checked after each read so
        that a pid reused by another container is not believed."""
        self.procfs = procfs
        self._container_of = container_of or (lambda pid: read_container_id(procfs, pid))
        self._own = _own_container(procfs)
        self._devices: dict[str, VisibleDevices] = {}
        self._failed: dict[str, list[int]] = {}  # the pids whose read failed, per container
        self._kube: KubeView | None = None
        self._made: tuple[object, ...] = ()
        self._view = KubeView()
        self.reads = 0  # environ files opened, for tests and the cost figures

    def view(
        self,
        kube: KubeView,
        container_ids: set[str],
        increases: Iterable[ProcessLabels],
        gpus: Sequence[GpuReading],
    ) -> KubeView:
        """`kube` with the devices the environment of this sample's containers gives them; `kube`
        itself where it does not ask for that (pod-resources answered) or nothing is learned."""
        if not kube.learn_from_environment or not kube.containers:
            self._devices.clear()
            self._failed.clear()
            return kube
        present = container_ids & kube.containers.keys()
        present.discard(self._own)
        for gone in self._devices.keys() - present:
            del self._devices[gone]
        new = present - self._devices.keys()
        if new:
            self._learn(new, increases, gpus)
        holding = {cid: found for cid, found in self._devices.items() if found}
        if not holding:
            return kube
        made = (tuple(holding.items()), tuple(map(_IDENTITY, gpus)))
        if kube is not self._kube or made != self._made:
            learned = _learned(holding, kube, gpus)
            self._view = KubeView(kube.containers, kube.devices, True, learned)
            self._kube, self._made = kube, made
        return self._view

    def _learn(
        self, new: set[str], increases: Iterable[ProcessLabels], gpus: Sequence[GpuReading]
    ) -> None:
        """Read up to MAX_READS of the new containers, each from its lowest pid not tried yet (or,
        all tried, its lowest again: one caught in exec reads empty)."""
        for gone in self._failed.keys() - new:
            del self._failed[gone]
        untried: dict[str, int] = {}
        lowest: dict[str, int] = {}
        on_gpus = (
            (proc.pid, proc.comm, proc.container_id) for gpu in gpus for proc in gpu.processes
        )
        for pid, _, cid in chain(increases, on_gpus):
            if cid in new and pid < lowest.get(cid, pid + 1):
                lowest[cid] = pid
            if (
                cid in new
                and pid < untried.get(cid, pid + 1)
                and pid not in self._failed.get(cid, ())
            ):
                untried[cid] = pid
        for cid in sorted(lowest)[:MAX_READS]:
            pid = untried.get(cid, lowest[cid])
            found = self._read(pid, cid)
            if found is None:
                self._failed.setdefault(cid, []).append(pid)
                if len(self._failed[cid]) < MAX_TRIES:
                    continue
                found = NO_DEVICES
            self._settle(cid, found)

    def _settle(self, cid: str, found: VisibleDevices) -> None:
        self._devices[cid] = found
        self._failed.pop(cid, None)

    def _read(self, pid: int, cid: str) -> VisibleDevices | None:
        """The device variables of one process, None where it cannot be read as `cid`'s."""
        self.reads += 1
        try:
            with open(f"{self.procfs}/{pid}/environ", "rb") as file:
                data = file.read(MAX_ENVIRON_BYTES)
        except OSError:  # gone, hidden (hidepid), or not ours to read (no CAP_SYS_PTRACE)
            return None
        if not data or self._container_of(pid) != cid:  # exited mid-read, or the pid was reused
            return None
        if len(data) == MAX_ENVIRON_BYTES:  # cut: the last entry may be part of one
            data = data[: data.rfind(b"\0") + 1]
        return parse_environ(data)


def _learned(
    holding: Mapping[str, VisibleDevices], kube: KubeView, gpus: Sequence[GpuReading]
) -> dict[str, tuple[Holder, ...]]:
    """Device key -> its holders. A container that names a device holds it; one given every
    NVIDIA GPU by `all` (as the device plugin and monitoring daemons are) holds only the devices
    no container names."""
    by_name: dict[str, list[Holder]] = {}
    by_all: dict[str, list[Holder]] = {}
    for cid, visible in holding.items():
        keys, everything = named(visible, gpus)
        holder = Holder(cid, kube.containers[cid], ENVIRONMENT)
        for key in keys:
            (by_all if everything else by_name).setdefault(key, []).append(holder)
    return {key: tuple(holders) for key, holders in {**by_all, **by_name}.items()}


def _own_container(procfs: str) -> str:
    """The agent's own container ('' on the host, or where its cgroup namespace hides it, which
    hides it from the process rows too)."""
    try:
        with open(f"{procfs}/self/cgroup", encoding="utf-8", errors="replace") as file:
            return container_id(file.read())
    except OSError:
        return ""
