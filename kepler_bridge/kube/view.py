"""What the agent knows about Kubernetes at one moment: container owners and device assignments."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Mapping

from kepler_bridge.model import GpuReading, Holder, MigInstance, PodRef

_PCI = re.compile(r"^(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_INTEL_REPLICA = re.compile(r"^(card\d+)-\d+$")
_ASCEND_VNPU = re.compile(r"^(ascend\d{3}[bp]?)-\d+c[a-z0-9.]*-\d+-(\d+)$")


@dataclass(frozen=True)
class Assignment:
    """One device the kubelet assigned to a container (pod-resources List)."""

    device_id: str
    resource: str
    owner: PodRef


def device_key(device_id: str) -> str:
    """A device plugin's id in the form GPU readings use.

    ``GPU-<uuid>::3`` (a time-slicing replica) is the GPU ``GPU-<uuid>``;
    ``MIG-GPU-<uuid>/1/0`` (older MIG naming) is its parent GPU; PCI addresses
    (AMD's plugin) lose the domain's leading zeros; MIG-<uuid> stays (matched
    against the GPU's MIG instances); Intel's ``card0-1`` (a shared replica)
    is ``card0``; an Ascend vNPU ``Ascend310P-2c-100-1`` is ``ascend310p-1``.
    """
    key = device_id.strip().lower().split("::", 1)[0]
    if key.startswith("mig-gpu-"):
        key = key[len("mig-") :].split("/", 1)[0]
    key = _INTEL_REPLICA.sub(r"\1", key)
    key = _ASCEND_VNPU.sub(r"\1-\2", key)
    pci = _PCI.match(key)
    if pci:
        domain, bus, device, function = pci.groups()
        key = f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"
    return key


def device_owners(assignments: Iterable[Assignment]) -> dict[str, tuple[PodRef, ...]]:
    """Device key -> the containers holding it (several for MIG slices or shared replicas of one
    GPU)."""
    owners: dict[str, dict[PodRef, None]] = {}
    for assignment in assignments:
        owners.setdefault(device_key(assignment.device_id), {})[assignment.owner] = None
    return {key: tuple(found) for key, found in owners.items()}


@dataclass(frozen=True)
class KubeView:
    """Container id -> container, and device key -> owners; treat both mappings as read-only.

    Where pod-resources gave no answer (`learn_from_environment`), the sampler adds `learned`:
    device key -> the containers whose processes' environment gives them the device. A device
    pod-resources assigns keeps those holders; only the others take the learned ones."""

    containers: Mapping[str, PodRef] = field(default_factory=dict)
    devices: Mapping[str, tuple[PodRef, ...]] = field(default_factory=dict)
    learn_from_environment: bool = False
    learned: Mapping[str, tuple[Holder, ...]] = field(default_factory=dict)

    def gpu_owners(self, gpu: GpuReading) -> tuple[PodRef, ...]:
        """The containers the kubelet assigned this GPU, or a MIG instance, replica or slice of it,
        to."""
        return self._owners(_names(gpu))

    def holders(self, gpu: GpuReading) -> tuple[Holder, ...]:
        """The containers holding this GPU (`gpu_owners`), each with its id where the pod list
        names it; else those its environment gives it to."""
        return self._held(self.gpu_owners(gpu)) or self._learned(_names(gpu))

    def mig_holders(self, instance: MigInstance) -> tuple[Holder, ...]:
        """The containers the kubelet assigned this MIG device to (`nvidia.com/mig-*` resources);
        else those its environment gives it to."""
        return self._held(self._owners((instance.uuid,))) or self._learned((instance.uuid,))

    def _owners(self, names: Iterable[str]) -> tuple[PodRef, ...]:
        if not self.devices:
            return ()
        owners: dict[PodRef, None] = {}
        for name in names:
            if name:
                owners.update(dict.fromkeys(self.devices.get(device_key(name), ())))
        return tuple(owners)

    def _learned(self, names: Iterable[str]) -> tuple[Holder, ...]:
        if not self.learned:
            return ()
        holders: dict[Holder, None] = {}
        for name in names:
            if name:
                holders.update(dict.fromkeys(self.learned.get(device_key(name), ())))
        return tuple(holders)

    def _held(self, owners: tuple[PodRef, ...]) -> tuple[Holder, ...]:
        return tuple(Holder(self._ids.get(owner, ""), owner) for owner in owners)

    @cached_property
    def _ids(self) -> dict[PodRef, str]:
        return {owner: container_id for container_id, owner in self.containers.items()}


def _names(gpu: GpuReading) -> tuple[str, ...]:
    """Every name a device plugin or a runtime may give this device or a part of it."""
    return (gpu.uuid, *gpu.mig_uuids, gpu.pci_bus_id, *gpu.device_ids)
