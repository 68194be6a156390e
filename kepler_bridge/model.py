"""Readings returned by sources and the immutable snapshot the sampler publishes.

Units are the contract's base units: bytes, watts, joules, hertz, celsius,
ratios 0..1. ``None`` means "this device cannot report it" and is omitted
from every output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, is_, itemgetter
from typing import Any, Hashable, Mapping, NamedTuple, TypeVar

# Above any physical reading, and every 32/64-bit "not available" sentinel we see; below it whole
# numbers stay exact as floats, 256 devices' memory sums below Go's uint64 limit, and energy
# arithmetic stays finite.
MAX_EXACT = 2**53
# Per source; more is refused: each device costs dozens of series and a /v1/collect entry.
MAX_DEVICES = 256
K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
# Readings with a physical range, which the sanitiser holds every source to, plug-ins included
# (sampling/sanitize.py): a value outside it is a sentinel, garbage or a unit slip, and dropped.
Ratio = float | None  # 0..1
FanRatio = float | None  # 0..2: NVML's fan percent "may exceed 100%"
Celsius = float | None  # -55..150: edge boards run below freezing
Watts = float | None  # 0..5 kW
Hertz = float | None  # 1 Hz..10 GHz


@dataclass(frozen=True)
class PodRef:
    """The Kubernetes container a row belongs to: its namespace, pod and container labels;
    empty outside Kubernetes."""

    namespace: str = ""
    pod: str = ""
    container: str = ""


NO_POD = PodRef()


# How a device's holder was learned: the kubelet's pod-resources socket, or the environment of
# the container's processes (where pod-resources gives no answer: KubeEdge).
POD_RESOURCES = "pod-resources"
ENVIRONMENT = "environment"


@dataclass(frozen=True)
class Holder:
    """A container the kubelet assigned a device to; `container_id` where the pod list names it,
    else ''; `source` says how that was learned."""

    container_id: str
    owner: PodRef
    source: str = POD_RESOURCES


class ProcessKey(NamedTuple):
    """A process as its series names it: the key of every per-process count."""

    pid: int
    comm: str
    container_id: str


# A process's labels as the sampler keys its counts: a ProcessKey, or the plain tuple equal to one
# that `process_labels` takes from a row (made in C: no Python call per row of thousands).
ProcessLabels = tuple[int, str, str]
process_labels = attrgetter("pid", "comm", "container_id")


@dataclass(frozen=True)
class GpuProcess:
    """One process using an accelerator."""

    pid: int
    comm: str = ""
    memory_used_bytes: int | None = None
    utilization: Ratio = None
    container_id: str = ""
    owner: PodRef = NO_POD  # set by the sampler

    @property
    def key(self) -> ProcessKey:
        """The labels its series go by."""
        return ProcessKey(self.pid, self.comm, self.container_id)


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU: whether it is up, and its counters since the driver loaded (absent
    while it is down)."""

    link: int
    up: bool
    transmit_bytes: int | None = None
    receive_bytes: int | None = None
    errors: tuple[tuple[str, int], ...] = ()  # (kind, count): crc_flit, crc_data, replay, recovery


@dataclass(frozen=True)
class MigInstance:
    """One MIG device of a GPU in MIG mode: compute instance `compute_instance` of GPU instance
    `gpu_instance`; memory and compute slices are its GPU instance's."""

    gpu_instance: int
    compute_instance: int
    uuid: str
    profile: str = ""  # the GPU instance profile, e.g. 1g.10gb
    slices: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    pids: tuple[int, ...] = ()  # its processes, each also one of the GPU's processes
    holders: tuple[Holder, ...] = ()  # set by the sampler: the containers assigned this device
    # GPM profiling of its GPU instance (nvmlGpmMigSampleGet), ratios 0..1; None: not reported.
    sm_active: Ratio = None
    sm_occupancy: Ratio = None
    graphics_active: Ratio = None
    tensor_active: Ratio = None
    dram_active: Ratio = None


@dataclass(frozen=True)
class GpuReading:
    """One accelerator as a source read it; ``index`` is the source-local order."""

    index: int
    uuid: str
    vendor: str
    model: str
    up: bool = True
    error: str = ""
    driver_version: str = ""
    pci_bus_id: str = ""
    utilization: Ratio = None
    memory_utilization: Ratio = None
    encoder_utilization: Ratio = None
    decoder_utilization: Ratio = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    temperature_celsius: Celsius = None
    memory_temperature_celsius: Celsius = None
    power_watts: Watts = None
    power_limit_watts: Watts = None
    energy_joules: float | None = None
    sm_clock_hertz: Hertz = None
    memory_clock_hertz: Hertz = None
    fan_speed_ratio: FanRatio = None
    pcie_transmit_bytes_per_second: float | None = None
    pcie_receive_bytes_per_second: float | None = None
    performance_state: int | None = None
    throttled: tuple[tuple[str, bool], ...] = ()
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    xid_errors: tuple[
        tuple[int | str, int], ...
    ] = ()  # (code, count); code "other" sums the rarer codes
    last_xid_timestamp: float | None = None
    processes: tuple[GpuProcess, ...] = ()
    # UUIDs of the MIG instances carved out of this GPU (the kubelet hands those to pods).
    mig_uuids: tuple[str, ...] = ()
    # Other names device plugins give this device in pod-resources (Intel: card0;
    # Ascend: Ascend910-0).
    device_ids: tuple[str, ...] = ()
    # False where the source cannot list the device's processes: no process then means unknown,
    # not none running.
    lists_processes: bool = True
    # Set by the sampler: the containers the kubelet assigned the device (or a MIG instance,
    # replica, slice) to.
    holders: tuple[Holder, ...] = ()
    # GPM profiling (NVIDIA Hopper and newer), between the last two samples: ratios 0..1 and bytes
    # per second; (name, ratio) pairs for the SM pipes and the media engines.
    sm_active: Ratio = None
    sm_occupancy: Ratio = None
    graphics_active: Ratio = None
    tensor_active: Ratio = None
    pipe_active: tuple[tuple[str, float], ...] = ()
    dram_active: Ratio = None
    profiled_pcie_transmit_bytes_per_second: float | None = None
    profiled_pcie_receive_bytes_per_second: float | None = None
    profiled_nvlink_transmit_bytes_per_second: float | None = None
    profiled_nvlink_receive_bytes_per_second: float | None = None
    engine_active: tuple[tuple[str, float], ...] = ()
    # Reliability and links (NVML): counters since the driver loaded, flags 0/1.
    nvlinks: tuple[NvLink, ...] = ()
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    pcie_replays: int | None = None
    memory_reserved_bytes: int | None = None
    # (reason, seconds the clocks were held down for it): power, thermal, sync_boost, ...
    clock_event_seconds: tuple[tuple[str, float], ...] = ()
    # MIG: the MIG devices of a GPU in MIG mode, in NVML's order; () when not in MIG mode.
    mig_instances: tuple[MigInstance, ...] = ()
    # The code of the last XID the driver reported (DCGM_FI_DEV_XID_ERRORS); None before any.
    last_xid_code: int | None = None

    @property
    def holder(self) -> Holder | None:
        """The one container holding the device (gpu_pod_info); None when none or several do."""
        return self.holders[0] if len(self.holders) == 1 else None


@dataclass(frozen=True)
class ProcessCpu:
    """CPU time one process (thread group) has used, as a monotonic counter."""

    pid: int
    comm: str
    cpu_seconds: float
    container_id: str = ""
    # When it started (the source's units, 0 if not known): a pid reused under the same labels is
    # another process, whose counter starts again even when it reads no less than the last one.
    start: int = field(default=0, compare=False)

    @property
    def key(self) -> ProcessKey:
        """The labels its series go by."""
        return ProcessKey(self.pid, self.comm, self.container_id)


@dataclass(frozen=True)
class RaplZone:
    """One RAPL powercap zone's raw energy counter, which wraps at max_energy_range_uj."""

    id: str  # the sysfs zone directory, e.g. intel-rapl:0:1: identity of the counter
    zone: str  # its kind, the socket suffix dropped: package, core, uncore, dram, psys
    energy_uj: int
    max_energy_range_uj: int


@dataclass(frozen=True)
class CpuTimes:
    """Busy and total time of all CPUs since boot (the `cpu` line of /proc/stat)."""

    busy_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class SourceReading:
    """Everything one source returned for one sample."""

    gpus: tuple[GpuReading, ...] = ()
    processes: tuple[ProcessCpu, ...] = ()
    ebpf_programs_attached: int | None = None
    rapl_zones: tuple[RaplZone, ...] = ()
    cpu_times: CpuTimes | None = None


# A source in use is up or down (failing); one not in use stands by for its fallback or has no
# hardware here.
SOURCE_STATES = ("up", "down", "standby", "absent")


@dataclass(frozen=True)
class SourceStatus:
    """Health of one source as of the snapshot."""

    name: str
    up: bool
    error: str = ""
    errors_total: int = 0
    # Why the source is not in use: "standby" (a fallback runs instead) or "absent" (no hardware).
    not_in_use: str = ""

    @property
    def state(self) -> str:
        """One of SOURCE_STATES: up or down while in use, else why it is not in use."""
        return self.not_in_use or ("up" if self.up else "down")


@dataclass(frozen=True)
class ContainerCpu:
    """CPU seconds of a container's processes, as a monotonic counter, and the container's owner."""

    container_id: str
    cpu_seconds: float
    owner: PodRef = NO_POD


@dataclass(frozen=True)
class CpuZoneEnergy:
    """Joules of one CPU energy zone since the agent started; source is rapl or estimate."""

    zone: str
    source: str
    joules: float


@dataclass(frozen=True)
class WorkloadEnergy:
    """Joules attributed to one process, container or pod since the agent started;
    unused labels are ''."""

    pid: str = ""
    comm: str = ""
    container_id: str = ""
    owner: PodRef = NO_POD  # a pod's row: its namespace and pod only
    cpu_joules: float = 0.0
    gpu_joules: float = 0.0


@dataclass(frozen=True)
class Energy:
    """Energy counters of one sample: node zones, GPU idle and unattributed energy (by uuid) and
    the attributed levels; the process rows of each kind are its top N by that kind's joules
    (`process_metrics`), plus pid="other"."""

    cpu_zones: tuple[CpuZoneEnergy, ...] = ()
    gpu_idle: tuple[tuple[str, float], ...] = ()
    gpu_unattributed: tuple[tuple[str, str, float], ...] = ()  # (uuid, reason, joules)
    cpu_processes: tuple[WorkloadEnergy, ...] = ()
    gpu_processes: tuple[WorkloadEnergy, ...] = ()
    containers: tuple[WorkloadEnergy, ...] = ()
    pods: tuple[WorkloadEnergy, ...] = ()


@dataclass(frozen=True)
class DeviceAnomaly:
    """What the anomaly detectors make of one device: the kinds firing now, and the model's score
    (0..1) and fit time where it has a model."""

    uuid: str
    firing: tuple[str, ...] = ()
    score: float | None = None
    fitted_timestamp: float | None = None


@dataclass(frozen=True)
class Anomalies:
    """The anomaly thread's latest findings, per device in `gpu` order."""

    kinds: tuple[str, ...]
    devices: tuple[DeviceAnomaly, ...] = ()
    cpu_seconds: float = 0.0  # the anomaly thread's CPU time since it started


@dataclass(frozen=True)
class Snapshot:
    """One published sample of the whole node; never mutated after publication."""

    node: str
    timestamp: float
    duration_seconds: float
    interval_seconds: float
    sources: tuple[SourceStatus, ...] = ()
    gpus: tuple[GpuReading, ...] = ()  # in `gpu` index order
    # The processes shown (top N by CPU seconds) with their series' values, and the seconds of all
    # the others.
    processes: tuple[ProcessCpu, ...] = ()
    process_cpu_other: float | None = None
    # Top N of each per-process family (process_metrics); None: all, 0: none.
    process_limit: int | None = None
    containers: tuple[ContainerCpu, ...] = ()
    ebpf_programs_attached: int | None = None
    energy: Energy = Energy()
    state_save_errors: int = 0  # failed saves of the counter state for a next worker
    anomalies: Anomalies | None = None  # set by the store: the anomaly thread's latest findings


def top(values: Mapping[K, float], limit: int | None) -> list[K]:
    """The keys of the `limit` highest values, highest first, equal values in their order in
    `values`; every key when limit is None."""
    # One sort in C: heapq.nlargest loops in Python, and costs most where the values come in
    # ascending order (the newest process last with the lowest total is common, the reverse too).
    ranked = sorted(values.items(), key=itemgetter(1), reverse=True)
    return [key for key, _ in (ranked if limit is None else ranked[:limit])]


def replaced(record: R, **changes: Any) -> R:
    """A copy of a record (one of the frozen dataclasses above) with some fields changed; the
    record itself where each already holds the very object given.

    What `dataclasses.replace` gives, at a fraction of its cost: no __init__ runs, which none of
    these classes needs."""
    fields = record.__dict__
    if not fields.keys() >= changes.keys():
        unknown = sorted(changes.keys() - fields.keys())
        raise TypeError(f"{type(record).__name__} has no field {unknown}")
    if all(map(is_, map(fields.__getitem__, changes), changes.values())):
        return record
    copy = object.__new__(type(record))
    copy.__dict__.update(fields, **changes)
    return copy


def made(cls: type[R], fields: dict[str, Any]) -> R:
    """A record of `cls` (one of the frozen dataclasses above) holding `fields`, a new dict of
    every one of its fields, which the record takes as its own: no __init__, no copy."""
    record = object.__new__(cls)
    object.__setattr__(record, "__dict__", fields)
    return record
