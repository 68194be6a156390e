"""The accelerator series under dcgm-exporter's names, units and labels (--metric-names dcgm).

The names, units, types and labels are those of NVIDIA's dcgm-exporter (its etc/*.csv counter lists
and its metric template), so its dashboards and alert rules read this agent unchanged. dcgm-exporter
declares some fields counters without the _total that a counter needs in OpenMetrics; those are
exported untyped, under the same names. A GPU in MIG mode keeps its device series and adds one
per GPU instance, labelled GPU_I_ID and GPU_I_PROFILE, for the fields in dcgm_mig.py.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from kepler_bridge.exposition.dcgm_fields import DEVICE, Field
from kepler_bridge.exposition.dcgm_mig import instance_series
from kepler_bridge.exposition.dcgm_profiling import PROFILING
from kepler_bridge.model import GpuReading, Snapshot

# Every field, in the order of the exposition.
FIELDS: tuple[Field, ...] = DEVICE + PROFILING


def labels(node: str, gpu: GpuReading) -> dict[str, str]:
    """dcgm-exporter's labels of a device: `device` is nvidia<gpu> (dcgm-exporter: the minor
    number, the same on most nodes); the pod labels where the kubelet assigns the device."""
    named = {
        "gpu": str(gpu.index),
        "UUID": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "device": f"nvidia{gpu.index}",
        "modelName": gpu.model,
        "Hostname": node,
        "DCGM_FI_DRIVER_VERSION": gpu.driver_version,
    }
    if gpu.holder is not None:
        owner = gpu.holder.owner
        named.update(namespace=owner.namespace, pod=owner.pod, container=owner.container)
    return named


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """One family per field, with a sample for each device that is up and reports the value, and
    for each of its MIG GPU instances that does."""
    devices = [(gpu, labels(snapshot.node, gpu)) for gpu in snapshot.gpus if gpu.up]
    for field in FIELDS:
        family = Metric(field.name, field.help, "gauge" if field.kind == "gauge" else "unknown")
        for gpu, device_labels in devices:
            value = field.read(gpu)
            if value is not None:
                family.samples.append(Sample(field.name, device_labels, value))
            for instance_labels, value in instance_series(field.name, gpu, device_labels):
                family.samples.append(Sample(field.name, instance_labels, value))
        yield family
