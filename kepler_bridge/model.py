"""Readings returned by sources and the immutable snapshot the sampler publishes.

Units are the contract's base units: bytes, watts, joules, hertz, celsius,
ratios 0..1. ``None`` means "this device cannot report it" and is omitted
from every output.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProcess:
    """One process using an accelerator."""

    pid: int
    comm: str = ""
    memory_used_bytes: int | None = None
    utilization: float | None = None
    namespace: str = ""
    pod: str = ""
    container: str = ""


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
    utilization: float | None = None
    memory_utilization: float | None = None
    encoder_utilization: float | None = None
    decoder_utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    fan_speed_ratio: float | None = None
    pcie_transmit_bytes_per_second: float | None = None
    pcie_receive_bytes_per_second: float | None = None
    performance_state: int | None = None
    throttled: tuple[tuple[str, bool], ...] = ()
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    xid_errors: tuple[tuple[int, int], ...] = ()
    last_xid_timestamp: float | None = None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class ProcessCpu:
    """CPU time one process (thread group) has used, as a monotonic counter."""

    pid: int
    comm: str
    cpu_seconds: float
    container_id: str = ""


@dataclass(frozen=True)
class SourceReading:
    """Everything one source returned for one sample."""

    gpus: tuple[GpuReading, ...] = ()
    processes: tuple[ProcessCpu, ...] = ()
    ebpf_programs_attached: int | None = None


@dataclass(frozen=True)
class SourceStatus:
    """Health of one source as of the snapshot."""

    name: str
    up: bool
    error: str = ""
    errors_total: int = 0


@dataclass(frozen=True)
class Snapshot:
    """One published sample of the whole node; never mutated after publication."""

    node: str
    timestamp: float
    duration_seconds: float
    interval_seconds: float
    sources: tuple[SourceStatus, ...] = ()
    gpus: tuple[GpuReading, ...] = ()
    processes: tuple[ProcessCpu, ...] = ()
    containers: tuple[tuple[str, float], ...] = ()
    ebpf_programs_attached: int | None = None
