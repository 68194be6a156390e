"""MIG: the GPU instances and compute instances of a GPU in MIG mode, read through MIG handles.

Each MIG device (a compute instance of a GPU instance, the unit the kubelet assigns) gives its
ids, uuid, memory (its GPU instance's) and processes (with their memory, the GPU's processes
where NVML refuses the parent's list: processes.py); the GPU instance's profile names it
(`1g.10gb`). A MIG device destroyed between samples is simply not listed; one destroyed while it
is read is skipped. Each GPU instance carries its GPM activity (`nvmlGpmMigSampleGet`, by GPU
instance id, sampled by gpm.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import pynvml

from kepler_bridge.model import MigInstance
from kepler_bridge.sources import ranges
from kepler_bridge.sources.nvml.device import UNSUPPORTED, Device, decoded, text
from kepler_bridge.sources.nvml.processes import COMPUTE, running_processes

# A MIG slot that holds no device, or a device destroyed since its handle was taken.
GONE = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)
# What a MIG device's call answers where NVML will not tell (GONE told apart: destroyed meanwhile).
CANNOT = tuple(code for code in UNSUPPORTED if code not in GONE)
# The name doctor gives the MIG devices NVML would not name (their ids or uuid: CANNOT).
UNNAMED = "mig_devices"


class Profile(NamedTuple):
    """A GPU instance profile: its name without NVML's "MIG " prefix, and its compute slices."""

    name: str
    slices: int | None


def add_mig(device: Device, fields: dict[str, Any]) -> None:
    """Add the GPU's MIG devices to its GpuReading fields when it is in MIG mode.

    A MIG parent reports no utilization (absent, never zero), and memory summed over its GPU
    instances where the parent cannot report its own. The mode changes only when an administrator
    resets the GPU: asked each sample while on, with the slow counters while off."""
    if device.mig_enabled or device.counters_due:
        mode = device.query("mig_mode", pynvml.nvmlDeviceGetMigMode, device.handle)
        device.mig_enabled = bool(mode) and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        if not device.mig_enabled:
            device.gpm.read_instances(device.handle, set(), device.index)  # frees any left
    if not device.mig_enabled:
        return
    instances = _profiled(device, _instances(device))
    if fields.get("memory_total_bytes") is None:
        fields["memory_used_bytes"], fields["memory_total_bytes"] = _summed(instances)
    fields.update(
        utilization=None,
        mig_uuids=tuple(instance.uuid for instance in instances),
        mig_instances=instances,
    )


def _profiled(device: Device, instances: tuple[MigInstance, ...]) -> tuple[MigInstance, ...]:
    """The instances with their GPU instance's GPM activity, where GPM reports it."""
    gpu_instances = {instance.gpu_instance for instance in instances}
    profiled = device.gpm.read_instances(device.handle, gpu_instances, device.index)
    return tuple(
        dataclasses.replace(instance, **profiled.get(instance.gpu_instance, {}))
        for instance in instances
    )


def _instances(device: Device) -> tuple[MigInstance, ...]:
    h = device.handle
    count = device.query("mig_count", pynvml.nvmlDeviceGetMaxMigDeviceCount, h) or 0
    found, unnamed = [], False
    listed: dict[int, int | None] = {}  # used memory by pid over the MIG devices' processes
    for index in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, index)
            found.append(_instance(device, mig, listed))
        except pynvml.NVMLError as err:
            unnamed = unnamed or err.value in CANNOT  # left out, its GPU read as ever
            if err.value not in CANNOT + GONE:
                raise
    if unnamed:
        device.cannot(UNNAMED)  # for doctor
    else:
        device.unsupported.pop(UNNAMED, None)
    device.mig_processes = listed
    return tuple(found)


def _instance(device: Device, mig: Any, listed: dict[int, int | None]) -> MigInstance:
    """One MIG device by its handle, its processes' used memory added to `listed` by pid; raises
    NVMLError (GONE) when it was destroyed meanwhile, or when NVML cannot tell its ids or uuid
    (CANNOT). Its memory, profile and processes are absent where NVML cannot report them."""
    gpu_instance = pynvml.nvmlDeviceGetGpuInstanceId(mig)
    memory = _optional(pynvml.nvmlDeviceGetMemoryInfo, mig)
    total = None if memory is None else ranges.byte_count(memory.total)
    used = None if memory is None else ranges.byte_count(memory.used)
    if used is not None and (total is None or used > total):
        used = None
    profile = _profile(device, gpu_instance)
    processes = _optional(running_processes, device, COMPUTE, mig) or ()
    instance = MigInstance(
        gpu_instance=gpu_instance,
        compute_instance=pynvml.nvmlDeviceGetComputeInstanceId(mig),
        uuid=text(pynvml.nvmlDeviceGetUUID, mig),
        profile=profile.name,
        slices=profile.slices,
        memory_used_bytes=used,
        memory_total_bytes=total,
        pids=tuple(sorted({pid for pid, _ in processes})),
    )
    for pid, process_used in processes:
        if listed.get(pid) is None:
            listed[pid] = process_used
    return instance


def _profile(device: Device, gpu_instance: int) -> Profile:
    """The profile of a GPU instance; unnamed where NVML cannot tell (no permission, old driver)."""
    h = device.handle
    instance = device.query(
        "mig_gpu_instance", pynvml.nvmlDeviceGetGpuInstanceById, h, gpu_instance
    )
    info = None if instance is None else _optional(pynvml.nvmlGpuInstanceGetInfo, instance)
    if info is None:
        return Profile("", None)
    return _profiles(device).get(info.profileId, Profile("", None))


def _optional(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, or None where NVML cannot tell (CANNOT); GONE and other errors raise."""
    try:
        return call(*args)
    except pynvml.NVMLError as err:
        if err.value in CANNOT:
            return None
        raise


def _profiles(device: Device) -> dict[int, Profile]:
    """Profile id -> profile, asked once per GPU handle (the table is the GPU model's)."""
    if device.mig_profiles is None:
        table = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device.handle, index)
            except pynvml.NVMLError as err:
                if err.value in UNSUPPORTED:  # a profile this GPU lacks, or an old driver
                    continue
                raise
            name = decoded(info.name).removeprefix("MIG ")
            table[info.id] = Profile(name, info.sliceCount or None)
        device.mig_profiles = table
    return device.mig_profiles


def _summed(instances: tuple[MigInstance, ...]) -> tuple[int | None, int | None]:
    """Used and total memory over the GPU instances, each counted once."""
    per_instance = {i.gpu_instance: i for i in instances if i.memory_total_bytes is not None}
    if not per_instance:
        return None, None
    total = sum(i.memory_total_bytes or 0 for i in per_instance.values())
    used = [i.memory_used_bytes for i in per_instance.values()]
    return (None if None in used else sum(u or 0 for u in used)), total
