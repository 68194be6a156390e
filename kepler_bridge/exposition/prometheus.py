"""Prometheus exposition of a snapshot through a custom prometheus_client Collector."""

from __future__ import annotations

from itertools import chain
from typing import Callable, Iterable, Iterator

from prometheus_client import ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kepler_bridge import __version__
from kepler_bridge.exposition.anomaly import anomaly_families
from kepler_bridge.exposition.catalogue import (
    GPU_GAUGES,
    GPU_LABELS,
    HEALTH,
    MIG_DEVICE_LABELS,
    MIG_INSTANCE_LABELS,
    MIG_PROFILING,
    POD_LABELS,
    PROCESS_LABELS,
    PROFILING_GAUGES,
    PROFILING_LABELLED,
)
from kepler_bridge.exposition.catalogue import METRICS as METRICS  # every name it can emit
from kepler_bridge.exposition.energy import energy_families
from kepler_bridge.exposition.families import counter, gauge, holder_labels, info, pod_labels
from kepler_bridge.exposition.reliability import FAMILIES as RELIABILITY
from kepler_bridge.exposition.reliability import series as reliability_series
from kepler_bridge.exposition.text_format import generate
from kepler_bridge.model import (
    SOURCE_STATES,
    Energy,
    GpuProcess,
    GpuReading,
    Snapshot,
    top,
)
from kepler_bridge.turns import TURNS


def exposed_name(family: Metric) -> str:
    """The name users see and filter by: counters end in _total, info in _info."""
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


# Families of a snapshot's accelerators under other names (exposition/dcgm.py).
DeviceNames = Callable[[Snapshot], Iterable[Metric]]


class SnapshotCollector(Collector):
    """Yields the metric families of one snapshot; `devices`, when given, names the accelerator
    series in place of the gpu_* families (gpu_up and the kepler_bridge_* series stay)."""

    def __init__(self, snapshot: Snapshot, devices: DeviceNames | None = None) -> None:
        self.snapshot = snapshot
        self.devices = devices

    def collect(self) -> Iterator[Metric]:
        if self.devices is None:
            yield from self._gpu_families()
        else:
            yield from self.devices(self.snapshot)
            ours = self._device_families()
            yield from (ours.up, ours.idle, ours.unattributed)
        yield from anomaly_families(self.snapshot, self._device_labels)
        yield from self._cpu_families()
        yield from energy_families(self.snapshot)
        yield from self._agent_families()

    def _device_labels(self, gpu: GpuReading) -> list[str]:
        return [self.snapshot.node, str(gpu.index), gpu.uuid, gpu.vendor, gpu.model]

    def _device_families(self) -> _DeviceFamilies:
        devices = _DeviceFamilies(self.snapshot.energy)
        for gpu in self.snapshot.gpus:
            TURNS.give_way()
            devices.add(self._device_labels(gpu), gpu)
        return devices

    def _gpu_families(self) -> Iterator[Metric]:
        processes = [
            (self._device_labels(gpu), proc)
            for gpu in self.snapshot.gpus
            if gpu.up
            for proc in gpu.processes
        ]
        TURNS.give_way()
        mig = _MigFamilies()
        for gpu in self.snapshot.gpus:
            if gpu.up:
                mig.add(self._device_labels(gpu), gpu)
        yield from self._device_families().families()
        yield from _process_gauges(processes, self.snapshot.process_limit)
        yield from mig.families()

    def _cpu_families(self) -> Iterator[Metric]:
        snap = self.snapshot
        process = counter(
            "kepler_bridge_process_cpu_seconds_total", ("node", "pid", "comm", "container_id")
        )
        for proc in snap.processes:
            process.add_metric(
                [snap.node, str(proc.pid), proc.comm, proc.container_id], proc.cpu_seconds
            )
        if snap.process_cpu_other is not None:
            process.add_metric([snap.node, "other", "", ""], snap.process_cpu_other)
        container = counter(
            "kepler_bridge_container_cpu_seconds_total", ("node", "container_id") + POD_LABELS
        )
        for row in snap.containers:
            container.add_metric(
                [snap.node, row.container_id, *pod_labels(row.owner)], row.cpu_seconds
            )
        yield process
        yield container

    def _agent_families(self) -> Iterator[Metric]:
        snap = self.snapshot
        build = info("kepler_bridge_build_info", ("node",))
        build.add_metric([snap.node], {"version": __version__})
        up = gauge("kepler_bridge_source_up", ("node", "source"))
        errors = counter("kepler_bridge_source_errors_total", ("node", "source"))
        # A source that is absent or stands by for its fallback is not down: it has a state,
        # but no up series.
        state = gauge("kepler_bridge_source_state", ("node", "source", "state"))
        for status in snap.sources:
            if not status.not_in_use:
                up.add_metric([snap.node, status.name], 1.0 if status.up else 0.0)
                errors.add_metric([snap.node, status.name], float(status.errors_total))
            for name in SOURCE_STATES:
                state.add_metric(
                    [snap.node, status.name, name], 1.0 if name == status.state else 0.0
                )
        duration = gauge("kepler_bridge_sample_duration_seconds", ("node",))
        duration.add_metric([snap.node], snap.duration_seconds)
        timestamp = gauge("kepler_bridge_last_sample_timestamp_seconds", ("node",))
        timestamp.add_metric([snap.node], snap.timestamp)
        saves = counter("kepler_bridge_state_save_errors_total", ("node",))
        saves.add_metric([snap.node], float(snap.state_save_errors))
        yield from (build, up, state, errors, duration, timestamp, saves)
        if snap.ebpf_programs_attached is not None:
            attached = gauge("kepler_bridge_ebpf_programs_attached", ("node",))
            attached.add_metric([snap.node], float(snap.ebpf_programs_attached))
            yield attached


class _DeviceFamilies:
    """The accelerator families of one snapshot, filled one device at a time."""

    def __init__(self, energy: Energy) -> None:
        self.info = info("gpu_info", GPU_LABELS)
        self.pod_info = info("gpu_pod_info", GPU_LABELS)
        self.up = gauge("gpu_up", GPU_LABELS)
        self.gauges = {name: gauge(name, GPU_LABELS) for name in GPU_GAUGES}
        self.energy = counter("gpu_energy_joules_total", GPU_LABELS)
        self.idle = counter("kepler_bridge_node_gpu_idle_joules_total", GPU_LABELS)
        self.unattributed = counter(
            "kepler_bridge_node_gpu_unattributed_joules_total", GPU_LABELS + ("reason",)
        )
        self.throttled = gauge("gpu_throttled", GPU_LABELS + ("reason",))
        self.ecc = counter("gpu_ecc_errors_total", GPU_LABELS + ("kind",))
        self.xid = counter("gpu_xid_errors_total", GPU_LABELS + ("xid",))
        self.profiling = {name: gauge(name, GPU_LABELS) for name in PROFILING_GAUGES}
        self.profiling_labelled = {
            name: gauge(name, GPU_LABELS + (label,))
            for name, (_, label, _) in PROFILING_LABELLED.items()
        }
        self.reliability = {
            name: (gauge if kind == "gauge" else counter)(name, GPU_LABELS + labels)
            for name, (kind, labels) in RELIABILITY.items()
        }
        self.idle_joules = dict(energy.gpu_idle)
        self.unattributed_joules: dict[str, list[tuple[str, float]]] = {}
        for uuid, reason, joules in energy.gpu_unattributed:
            self.unattributed_joules.setdefault(uuid, []).append((reason, joules))

    def add(self, labels: list[str], gpu: GpuReading) -> None:
        """The device's series: its identity and gpu_up always, its readings only when it is up."""
        identity = {"driver_version": gpu.driver_version, "pci_bus_id": gpu.pci_bus_id}
        self.info.add_metric(labels, identity)
        # Device series keep one label set for the device's life; its holder is a series of its own.
        if gpu.holder is not None:
            self.pod_info.add_metric(labels, holder_labels(gpu.holder))
        self.up.add_metric(labels, 1.0 if gpu.up else 0.0)
        if gpu.up:
            self._add_readings(labels, gpu)

    def _add_readings(self, labels: list[str], gpu: GpuReading) -> None:
        for name, (attribute, _) in GPU_GAUGES.items():
            value = getattr(gpu, attribute)
            if value is not None:
                self.gauges[name].add_metric(labels, float(value))
        if gpu.energy_joules is not None:
            self.energy.add_metric(labels, gpu.energy_joules)
        if gpu.uuid in self.idle_joules:
            self.idle.add_metric(labels, self.idle_joules[gpu.uuid])
        for reason, joules in self.unattributed_joules.get(gpu.uuid, ()):
            self.unattributed.add_metric(labels + [reason], joules)
        for reason, active in gpu.throttled:
            self.throttled.add_metric(labels + [reason], 1.0 if active else 0.0)
        ecc = (("corrected", gpu.ecc_corrected_total), ("uncorrected", gpu.ecc_uncorrected_total))
        for kind, count in ecc:
            if count is not None:
                self.ecc.add_metric(labels + [kind], float(count))
        for code, count in gpu.xid_errors:
            self.xid.add_metric(labels + [str(code)], float(count))
        self._add_profiling(labels, gpu)
        for name, more, value in reliability_series(gpu):
            self.reliability[name].add_metric(labels + more, value)

    def _add_profiling(self, labels: list[str], gpu: GpuReading) -> None:
        for name, (attribute, _) in PROFILING_GAUGES.items():
            value = getattr(gpu, attribute)
            if value is not None:
                self.profiling[name].add_metric(labels, float(value))
        for name, (attribute, _, _) in PROFILING_LABELLED.items():
            for label, ratio in getattr(gpu, attribute):
                self.profiling_labelled[name].add_metric(labels + [label], ratio)

    def families(self) -> Iterator[Metric]:
        """Every family, in the order of the exposition."""
        yield from (self.info, self.pod_info, self.up)
        yield from self.gauges.values()
        yield from (self.energy, self.idle, self.unattributed, self.throttled, self.ecc, self.xid)
        yield from self.profiling.values()
        yield from self.profiling_labelled.values()
        yield from self.reliability.values()


class _MigFamilies:
    """The MIG families: one series per MIG device, and memory and GPM per GPU instance."""

    def __init__(self) -> None:
        self.info = info("gpu_mig_info", MIG_DEVICE_LABELS)
        self.pod_info = info("gpu_mig_pod_info", MIG_DEVICE_LABELS)
        self.used = gauge("gpu_mig_memory_used_bytes", MIG_INSTANCE_LABELS)
        self.total = gauge("gpu_mig_memory_total_bytes", MIG_INSTANCE_LABELS)
        self.profiling = {name: gauge(name, MIG_INSTANCE_LABELS) for name in MIG_PROFILING}

    def add(self, labels: list[str], gpu: GpuReading) -> None:
        """The series of a GPU's MIG devices; a GPU instance's memory once, from its first."""
        seen: set[int] = set()
        for instance in gpu.mig_instances:
            ids = [str(instance.gpu_instance), str(instance.compute_instance), instance.uuid]
            self.info.add_metric(labels + ids, {"profile": instance.profile})
            if len(instance.holders) == 1:
                self.pod_info.add_metric(labels + ids, holder_labels(instance.holders[0]))
            if instance.gpu_instance in seen:
                continue
            seen.add(instance.gpu_instance)
            gpu_instance = labels + [str(instance.gpu_instance), instance.profile]
            if instance.memory_used_bytes is not None:
                self.used.add_metric(gpu_instance, float(instance.memory_used_bytes))
            if instance.memory_total_bytes is not None:
                self.total.add_metric(gpu_instance, float(instance.memory_total_bytes))
            for name, (attribute, _) in MIG_PROFILING.items():
                if getattr(instance, attribute) is not None:
                    self.profiling[name].add_metric(gpu_instance, getattr(instance, attribute))

    def families(self) -> Iterator[Metric]:
        """Every MIG family, in the order of the exposition."""
        yield from (self.info, self.pod_info, self.used, self.total)
        yield from self.profiling.values()


def _process_gauges(
    processes: list[tuple[list[str], GpuProcess]], limit: int | None
) -> Iterator[Metric]:
    """Each per-process GPU gauge: its top N by value, the rest summed per GPU as pid="other";
    none when off."""
    if limit == 0:
        return
    for name, attribute in (
        ("gpu_process_memory_used_bytes", "memory_used_bytes"),
        ("gpu_process_utilization_ratio", "utilization"),
    ):
        family = gauge(name, PROCESS_LABELS)
        values = {
            row: float(getattr(proc, attribute))
            for row, (_, proc) in enumerate(processes)
            if getattr(proc, attribute) is not None
        }
        shown = set(top(values, limit))
        other: dict[tuple[str, ...], float] = {}
        for row, value in values.items():
            gpu_labels, proc = processes[row]
            if row in shown:
                family.add_metric(
                    gpu_labels + [str(proc.pid), proc.comm, *pod_labels(proc.owner)], value
                )
            else:
                other[tuple(gpu_labels)] = other.get(tuple(gpu_labels), 0.0) + value
        for device_labels, value in other.items():
            family.add_metric([*device_labels, "other", "", "", "", ""], value)
        yield family


class _NodeLabelled(Collector):
    """Adds the node label to another collector's families (prometheus_client's process_*)."""

    def __init__(self, inner: Collector, node: str) -> None:
        self.inner = inner
        self.node = node

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            family.samples = [
                Sample(s.name, {"node": self.node, **s.labels}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
            yield family


class _Filtered(Collector):
    """Keeps only non-empty families that are health series or whose exposed name passes the
    allow/deny prefixes."""

    def __init__(self, inner: Collector, allowed: Callable[[str], bool]) -> None:
        self.inner = inner
        self.allowed = allowed

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            TURNS.give_way()
            if family.samples and (
                exposed_name(family) in HEALTH or self.allowed(exposed_name(family))
            ):
                yield family


def render(
    snapshot: Snapshot,
    allowed: Callable[[str], bool],
    openmetrics: bool = False,
    devices: DeviceNames | None = None,
) -> bytes:
    """Render a snapshot (plus the agent's own process_* metrics) in text or OpenMetrics format;
    `devices`: see SnapshotCollector."""
    ours = _Filtered(SnapshotCollector(snapshot, devices), allowed)
    process = _Filtered(_NodeLabelled(ProcessCollector(registry=None), snapshot.node), allowed)
    return generate(chain(ours.collect(), process.collect()), openmetrics)
