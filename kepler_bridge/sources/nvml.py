"""NVIDIA accelerators through NVML (the `pynvml` module of nvidia-ml-py)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pynvml

from kepler_bridge.sources.cgroup import read_container_id
from kepler_bridge.model import GpuProcess, GpuReading, SourceReading
from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable, device_reading, Retry
from kepler_bridge.sources.procfs import read_stat
from kepler_bridge.sources.sysfs import on_pci_bus

log = logging.getLogger(__name__)

MAX_DEVICE_BACKOFF_SECONDS = 30.0
EVENT_WAIT_MS = 250
MAX_XID_CODES = 64  # distinct xid label values per GPU, besides "other"
MIB = 1024 * 1024
NVIDIA_PCI_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"  # PCI class 03h: VGA and 3D controllers, not the cards' audio or USB functions
# Where driver packages put libnvidia-ml.so.1 under a /usr tree, searched when --nvml-library is a directory:
# Debian/Ubuntu amd64 and arm64 (Grace), Jetson (JetPack's tegra/), RHEL/SUSE, NVIDIA's container images.
LIBRARY = "libnvidia-ml.so.1"
LIBRARY_DIRS = ("lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu/tegra", "lib64",
                "local/nvidia/lib64", "lib")

# NVML answers meaning "this device cannot report this field": remembered, never asked again.
_UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_INVALID_ARGUMENT)

# Bits of nvmlDeviceGetCurrentClocksEventReasons, named as in NVML's header.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass
class _Device:
    """What the source remembers about one GPU between samples."""

    index: int
    handle: Any = None
    uuid: str = ""
    model: str = ""
    pci_bus_id: str = ""
    unsupported: set[str] = field(default_factory=set)
    error: str = ""
    retry: Retry = field(default_factory=lambda: Retry(MAX_DEVICE_BACKOFF_SECONDS))
    last_process_sample_us: int = 0
    comms: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (comm, container id)

    def fail(self, message: str, interval: float, now: float) -> None:
        self.handle, self.error = None, message
        self.retry.failed(interval, now)


class _XidCounter:
    """XID events counted per device by the event thread, read by the sampler.

    The MAX_XID_CODES codes seen most recently are counted each; an older one's count moves to "other", which
    only grows, so a driver reporting ever new codes cannot grow the series without bound.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[int, dict[int, int]] = {}  # in order of last occurrence, most recent last
        self.other: dict[int, int] = {}
        self.last: dict[int, float] = {}

    def add(self, index: int, xid: int) -> None:
        with self.lock:
            per_device = self.counts.setdefault(index, {})
            per_device[xid] = per_device.pop(xid, 0) + 1
            if len(per_device) > MAX_XID_CODES:
                oldest = next(iter(per_device))
                self.other[index] = self.other.get(index, 0) + per_device.pop(oldest)
            self.last[index] = time.time()

    def of(self, index: int) -> tuple[tuple[tuple[int | str, int], ...], float | None]:
        with self.lock:
            counts: list[tuple[int | str, int]] = sorted(self.counts.get(index, {}).items())
            if index in self.other:
                counts.append(("other", self.other[index]))
            return tuple(counts), self.last.get(index)


def _search_library(directory: Path) -> ctypes.CDLL:
    """The first libnvidia-ml.so.1 in `directory` or its LIBRARY_DIRS that loads here (skips other architectures)."""
    candidates = [directory / sub / LIBRARY for sub in ("", *LIBRARY_DIRS) if (directory / sub / LIBRARY).exists()]
    if not candidates:
        raise SourceAbsent(f"no {LIBRARY} in {directory} or its {', '.join(LIBRARY_DIRS)}: install the NVIDIA "
                           "driver, or pass --nvml-library the library's path")
    failures = []
    for candidate in candidates:
        try:
            return ctypes.CDLL(str(candidate))
        except OSError as err:
            failures.append(str(err))
    raise SourceUnavailable(f"no {LIBRARY} under {directory} can be loaded: {'; '.join(failures)}")


def _init() -> None:
    """nvmlInit, its failures as SourceUnavailable saying what to fix."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise SourceUnavailable("libnvidia-ml.so.1 not found: install the NVIDIA driver, mount the host's "
                                "driver libraries, or pass --nvml-library PATH") from None
    except pynvml.NVMLError_LibRmVersionMismatch:
        raise SourceUnavailable("NVML library and kernel driver versions differ: reboot the node or reload "
                                "the nvidia kernel module after a driver upgrade") from None
    except pynvml.NVMLError_DriverNotLoaded:
        raise SourceUnavailable("the NVIDIA kernel driver is not loaded: check `nvidia-smi` on the host "
                                "and load the driver (modprobe nvidia)") from None
    except pynvml.NVMLError as err:
        raise SourceUnavailable(f"nvmlInit failed: {err}; check `nvidia-smi` on the host") from None


class NvmlSource(Source):
    """Reads every NVIDIA GPU; a failing GPU is reported down alone and retried with backoff."""

    name = "nvml"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.devices: list[_Device] = []
        self.driver_version = ""
        self.xids = _XidCounter()
        self._stop = threading.Event()
        self._events: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._load_library()
            _init()
        except (SourceAbsent, SourceUnavailable) as err:
            # A driver library without NVIDIA hardware (preinstalled images, Jetson's limited NVML) is no failure.
            if on_pci_bus(self.config.sysfs, NVIDIA_PCI_VENDOR, DISPLAY_CLASS):
                raise SourceUnavailable(str(err)) from None
            raise SourceAbsent(f"no NVIDIA GPU on the PCI bus ({self.config.sysfs}/bus/pci/devices); "
                               f"NVML: {err}") from None
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            self.devices = [_Device(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as err:
            pynvml.nvmlShutdown()
            raise SourceUnavailable(f"NVML cannot list devices: {err}; check `nvidia-smi` on the host") from None
        self._stop.clear()
        self._events = threading.Thread(target=self._watch_xids, name="kepler-bridge-nvml-events", daemon=True)
        self._events.start()

    def _load_library(self) -> None:
        path = self.config.nvml_library
        if not path or pynvml.nvmlLib is not None:
            return
        if Path(path).is_dir():
            pynvml.nvmlLib = _search_library(Path(path))
            return
        if not Path(path).exists():
            raise SourceUnavailable(f"--nvml-library {path} does not exist: give the path of libnvidia-ml.so.1")
        try:
            pynvml.nvmlLib = ctypes.CDLL(path)
        except OSError as err:
            raise SourceUnavailable(f"--nvml-library {path} cannot be loaded: {err}") from None

    def stop(self) -> None:
        self._stop.set()
        if self._events is not None:
            self._events.join(EVENT_WAIT_MS / 1000 * 2)
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.debug("nvmlShutdown: %s", err)

    def read(self) -> SourceReading:
        now = time.monotonic()
        gpus = tuple(self._read_device(device, now) for device in self.devices)
        return device_reading(gpus, "GPU")

    def describe(self, reading: SourceReading) -> str:
        models = sorted({gpu.model for gpu in reading.gpus})
        return f"{len(reading.gpus)} GPU(s) {', '.join(models)}; driver {self.driver_version}"

    def _down(self, device: _Device) -> GpuReading:
        return GpuReading(index=device.index, uuid=device.uuid, vendor="nvidia", model=device.model,
                          up=False, error=device.error, driver_version=self.driver_version,
                          pci_bus_id=device.pci_bus_id)

    def _read_device(self, device: _Device, now: float) -> GpuReading:
        if device.handle is None:
            if not device.retry.due(now):
                return self._down(device)
            try:
                self._acquire(device)
            except pynvml.NVMLError as err:
                device.fail(str(err), self.config.interval, now)
                return self._down(device)
        try:
            reading = self._values(device)
        except pynvml.NVMLError as err:
            log.warning("GPU %d: %s; retrying in %.0fs", device.index, err, max(device.retry.delay * 2, 1))
            device.fail(str(err), self.config.interval, now)
            return self._down(device)
        device.error = ""
        device.retry.succeeded()
        return reading

    def _acquire(self, device: _Device) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        device.uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        device.model = _text(pynvml.nvmlDeviceGetName(handle))
        device.pci_bus_id = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        device.unsupported.clear()
        device.handle = handle

    def _field(self, device: _Device, name: str, call: Callable[[], Any]) -> Any:
        """One NVML call; None when the device cannot report it (remembered). Other errors propagate."""
        if name in device.unsupported:
            return None
        try:
            return call()
        except pynvml.NVMLError as err:
            if err.value in _UNSUPPORTED:
                device.unsupported.add(name)
                return None
            raise

    def _values(self, device: _Device) -> GpuReading:
        h = device.handle
        f = self._field
        utilization = f(device, "utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        encoder = f(device, "encoder", lambda: pynvml.nvmlDeviceGetEncoderUtilization(h))
        decoder = f(device, "decoder", lambda: pynvml.nvmlDeviceGetDecoderUtilization(h))
        used, total, free = self._memory(device)
        power = f(device, "power", lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        limit = f(device, "power_limit", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h))
        energy = f(device, "energy", lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        sm_clock = f(device, "sm_clock", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
        mem_clock = f(device, "mem_clock", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM))
        fan = f(device, "fan", lambda: pynvml.nvmlDeviceGetFanSpeed(h))
        tx = f(device, "pcie_tx", lambda: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES))
        rx = f(device, "pcie_rx", lambda: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES))
        pstate = f(device, "pstate", lambda: pynvml.nvmlDeviceGetPerformanceState(h))
        xids, last_xid = self.xids.of(device.index)
        return GpuReading(
            index=device.index, uuid=device.uuid, vendor="nvidia", model=device.model,
            driver_version=self.driver_version, pci_bus_id=device.pci_bus_id,
            utilization=ranges.ratio_from_percent(utilization.gpu if utilization else None),
            memory_utilization=ranges.ratio_from_percent(utilization.memory if utilization else None),
            encoder_utilization=ranges.ratio_from_percent(encoder[0] if encoder else None),
            decoder_utilization=ranges.ratio_from_percent(decoder[0] if decoder else None),
            memory_used_bytes=used, memory_total_bytes=total, memory_free_bytes=free,
            temperature_celsius=ranges.celsius(
                f(device, "temperature", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
            memory_temperature_celsius=ranges.celsius(self._memory_temperature(device)),
            power_watts=ranges.watts(power / 1000 if power is not None else None),
            power_limit_watts=ranges.watts(limit / 1000 if limit is not None else None),
            energy_joules=energy / 1000 if energy is not None and energy < 2**63 else None,
            sm_clock_hertz=ranges.hertz(sm_clock * 1e6 if sm_clock is not None else None),
            memory_clock_hertz=ranges.hertz(mem_clock * 1e6 if mem_clock is not None else None),
            fan_speed_ratio=ranges.ratio_from_percent(fan),
            pcie_transmit_bytes_per_second=ranges.bounded(tx * 1024 if tx is not None else None,
                                                          0, ranges.MAX_BYTES_PER_SECOND),
            pcie_receive_bytes_per_second=ranges.bounded(rx * 1024 if rx is not None else None,
                                                         0, ranges.MAX_BYTES_PER_SECOND),
            performance_state=pstate if pstate is not None and 0 <= pstate <= 15 else None,
            throttled=self._throttled(device),
            ecc_corrected_total=self._ecc(device, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected_total=self._ecc(device, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            xid_errors=xids, last_xid_timestamp=last_xid,
            processes=self._processes(device),
            mig_uuids=self._mig_uuids(device),
        )

    def _memory(self, device: _Device) -> tuple[int | None, int | None, int | None]:
        h = device.handle
        info = self._field(device, "memory_v2", lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2))
        if info is None:
            info = self._field(device, "memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
        if info is None:
            return None, None, None
        total = ranges.byte_count(info.total)
        used = ranges.byte_count(info.used)
        free = ranges.byte_count(info.free)
        if total is None:
            return None, None, None
        return (used if used is not None and used <= total else None,
                total, free if free is not None and free <= total else None)

    def _memory_temperature(self, device: _Device) -> float | None:
        values = self._field(device, "memory_temperature",
                             lambda: pynvml.nvmlDeviceGetFieldValues(device.handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP]))
        if values is None:
            return None
        value = values[0]
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            device.unsupported.add("memory_temperature")
            return None
        return float(value.value.uiVal)

    def _throttled(self, device: _Device) -> tuple[tuple[str, bool], ...]:
        h = device.handle
        mask = self._field(device, "clocks_event_reasons", lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        if mask is None:
            mask = self._field(device, "throttle_reasons",
                               lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        if mask is None or mask >= 1 << 32:
            return ()
        return tuple((name, bool(mask & bit)) for bit, name in THROTTLE_REASONS)

    def _ecc(self, device: _Device, kind: int) -> int | None:
        count = self._field(device, f"ecc{kind}", lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            device.handle, kind, pynvml.NVML_VOLATILE_ECC))
        return count if count is not None and count < 2**63 else None

    def _processes(self, device: _Device) -> tuple[GpuProcess, ...]:
        h = device.handle
        memory: dict[int, int | None] = {}
        for name, call in (("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
                           ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses)):
            for proc in self._field(device, name, lambda: call(h)) or ():
                if memory.get(proc.pid) is None:
                    memory[proc.pid] = ranges.byte_count(proc.usedGpuMemory)
        if not memory:
            return ()
        utilization = self._process_utilization(device)
        device.comms = {pid: device.comms[pid] if pid in device.comms else self._identity(pid) for pid in memory}
        return tuple(GpuProcess(pid=pid, comm=device.comms[pid][0], memory_used_bytes=used,
                                utilization=None if utilization is None else utilization.get(pid, 0.0),
                                container_id=device.comms[pid][1])
                     for pid, used in sorted(memory.items()))

    def _process_utilization(self, device: _Device) -> dict[int, float] | None:
        """SM utilization per pid since the last sample; {} when nothing ran, None when not reported."""
        since = device.last_process_sample_us
        device.last_process_sample_us = int(time.time() * 1e6)
        try:
            samples = self._field(device, "process_utilization",
                                  lambda: pynvml.nvmlDeviceGetProcessUtilization(device.handle, since))
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):  # no kernel ran since `since`
                return {}
            raise
        if samples is None:
            return None
        latest: dict[int, tuple[int, float]] = {}
        for sample in samples:
            util = ranges.ratio_from_percent(sample.smUtil)
            if util is not None and sample.timeStamp >= latest.get(sample.pid, (0, 0.0))[0]:
                latest[sample.pid] = (sample.timeStamp, util)
        return {pid: util for pid, (_, util) in latest.items()}

    def _identity(self, pid: int) -> tuple[str, str]:
        """comm (as the CPU sources name it) and container id of a process; '' where the agent cannot see it."""
        stat = read_stat(self.config.procfs, pid)
        if stat is None:
            return "", ""
        return stat.comm, read_container_id(self.config.procfs, pid) or ""

    def _mig_uuids(self, device: _Device) -> tuple[str, ...]:
        """UUIDs of the MIG instances of a GPU in MIG mode: the ids the kubelet assigns to pods."""
        h = device.handle
        mode = self._field(device, "mig_mode", lambda: pynvml.nvmlDeviceGetMigMode(h))
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return ()
        uuids = []
        for index in range(self._field(device, "mig_count", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(h)) or 0):
            try:
                uuids.append(_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, index))))
            except pynvml.NVMLError:  # an empty slot answers NOT_FOUND
                continue
        return tuple(uuids)

    def _watch_xids(self) -> None:
        """Event thread: blocks in nvmlEventSetWait and counts XID critical errors per GPU."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("XID events unavailable: %s", err)
            return
        indexes: dict[int | None, int] = {}
        for device in self.devices:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
                indexes[ctypes.cast(handle, ctypes.c_void_p).value] = device.index
            except pynvml.NVMLError as err:
                log.info("GPU %d: XID events unavailable: %s", device.index, err)
        try:
            while indexes and not self._stop.is_set():
                try:
                    data = pynvml.nvmlEventSetWait(event_set, EVENT_WAIT_MS)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as err:
                    log.debug("nvmlEventSetWait: %s", err)
                    self._stop.wait(1.0)
                    continue
                index = indexes.get(ctypes.cast(data.device, ctypes.c_void_p).value)
                if index is not None and data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                    self.xids.add(index, int(data.eventData))
        finally:
            pynvml.nvmlEventSetFree(event_set)
