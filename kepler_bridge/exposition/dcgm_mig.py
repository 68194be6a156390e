"""dcgm-exporter's per-GPU-instance series of a GPU in MIG mode: the fields it reports per GPU
instance, labelled GPU_I_ID and GPU_I_PROFILE beside the parent's device labels."""

from __future__ import annotations

import math
from typing import Callable, Iterator

from kepler_bridge.model import GpuReading, MigInstance

InstanceReader = Callable[[MigInstance], "float | None"]
MIB = 2.0**-20


def _mib(count: int | None) -> float | None:
    """Bytes as DCGM's whole MiB."""
    return None if count is None else float(math.floor(count * MIB))


def _free(instance: MigInstance) -> float | None:
    used, total = instance.memory_used_bytes, instance.memory_total_bytes
    return None if used is None or total is None else _mib(total - used)


# Field name -> its value of a GPU instance, in DCGM's unit; the fields dcgm-exporter reports per
# GPU instance that the agent has per GPU instance (memory, and GPM's nvmlGpmMigSampleGet).
PER_INSTANCE: dict[str, InstanceReader] = {
    "DCGM_FI_DEV_FB_USED": lambda instance: _mib(instance.memory_used_bytes),
    "DCGM_FI_DEV_FB_FREE": _free,
    "DCGM_FI_DEV_FB_TOTAL": lambda instance: _mib(instance.memory_total_bytes),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": lambda instance: instance.graphics_active,
    "DCGM_FI_PROF_SM_ACTIVE": lambda instance: instance.sm_active,
    "DCGM_FI_PROF_SM_OCCUPANCY": lambda instance: instance.sm_occupancy,
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": lambda instance: instance.tensor_active,
    "DCGM_FI_PROF_DRAM_ACTIVE": lambda instance: instance.dram_active,
}


def instance_series(
    name: str, gpu: GpuReading, device: dict[str, str]
) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of field `name` for each GPU instance of the GPU that reports it; the pod
    labels are those of the one container holding the GPU instance's MIG devices, if one does."""
    read = PER_INSTANCE.get(name)
    if read is None:
        return
    for gpu_instance, members in _by_gpu_instance(gpu).items():
        value = read(members[0])
        if value is None:
            continue
        labels = {k: v for k, v in device.items() if k not in ("namespace", "pod", "container")}
        labels.update(GPU_I_PROFILE=members[0].profile, GPU_I_ID=str(gpu_instance))
        holders = {holder.owner for member in members for holder in member.holders}
        if len(holders) == 1:
            owner = holders.pop()
            labels.update(namespace=owner.namespace, pod=owner.pod, container=owner.container)
        yield labels, value


def _by_gpu_instance(gpu: GpuReading) -> dict[int, list[MigInstance]]:
    """The MIG devices of each GPU instance (its memory and GPM are its first device's)."""
    found: dict[int, list[MigInstance]] = {}
    for instance in gpu.mig_instances:
        found.setdefault(instance.gpu_instance, []).append(instance)
    return found
