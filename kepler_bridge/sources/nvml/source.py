"""NVIDIA accelerators through NVML (the `pynvml` module of nvidia-ml-py)."""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import Any

import pynvml

from kepler_bridge.model import GpuReading, SourceReading, made
from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable, device_reading
from kepler_bridge.sources.nvml import gpm, library
from kepler_bridge.sources.nvml.device import (
    Device,
    Getters,
    Outputs,
    decoded,
    text,
    unsupported_summary,
)
from kepler_bridge.sources.nvml.events import XidEvents
from kepler_bridge.sources.nvml.mig import add_mig
from kepler_bridge.sources.nvml.pcie import PcieThroughput
from kepler_bridge.sources.nvml.processes import gpu_processes, pid_namespace_problem
from kepler_bridge.sources.nvml.reliability import reliability
from kepler_bridge.sources.sysfs import on_pci_bus
from kepler_bridge.turns import TURNS

log = logging.getLogger(__name__)

NVIDIA_PCI_VENDOR = "0x10de"
# PCI class 03h: VGA and 3D controllers, not the cards' audio or USB functions.
DISPLAY_CLASS = "0x03"

NOTHING_ANSWERED = (
    "NVML reports none of this GPU's values (every call: not supported); "
    "check it with `nvidia-smi -q -i {index}`"
)

UINT, ULONGLONG = ctypes.c_uint, ctypes.c_ulonglong

# Bits of nvmlDeviceGetCurrentClocksEventReasons, named as in NVML's header.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


class _Sampled(Outputs):
    """A utilization NVML gives with the period it was sampled over (encoder, decoder)."""

    _fields_ = (("value", UINT), ("period_us", UINT))


# Each sample's getters of one number, read in one loop (Device.numbers).
NUMBERS: Getters = (
    ("encoder", "nvmlDeviceGetEncoderUtilization", _Sampled, ()),
    ("decoder", "nvmlDeviceGetDecoderUtilization", _Sampled, ()),
    ("power", "nvmlDeviceGetPowerUsage", UINT, ()),
    ("power_limit", "nvmlDeviceGetEnforcedPowerLimit", UINT, ()),
    ("energy", "nvmlDeviceGetTotalEnergyConsumption", ULONGLONG, ()),
    ("sm_clock", "nvmlDeviceGetClockInfo", UINT, (pynvml.NVML_CLOCK_SM,)),
    ("mem_clock", "nvmlDeviceGetClockInfo", UINT, (pynvml.NVML_CLOCK_MEM,)),
    ("fan", "nvmlDeviceGetFanSpeed", UINT, ()),
    ("pstate", "nvmlDeviceGetPerformanceState", UINT, ()),
    ("temperature", "nvmlDeviceGetTemperature", UINT, (pynvml.NVML_TEMPERATURE_GPU,)),
    ("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", ULONGLONG, ()),
)
# Drivers before R535 name the clocks event reasons throttle reasons.
THROTTLE_REASONS_GETTER: Getters = (
    ("throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", ULONGLONG, ()),
)

# The fields each up GPU's reading starts from: the defaults of every field.
BLANK_FIELDS = vars(GpuReading(index=0, uuid="", vendor="nvidia", model=""))


class NvmlSource(Source):
    """Reads every NVIDIA GPU; a failing GPU is reported down alone and retried with backoff."""

    name = "nvml"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.devices: list[Device] = []
        self.driver_version = ""
        self.pid_namespace = ""
        self.xids = XidEvents()
        self.pcie = PcieThroughput()

    def start(self) -> None:
        try:
            library.load(self.config.nvml_library)
            library.init()
        except (SourceAbsent, SourceUnavailable) as err:
            # A driver library without NVIDIA hardware (preinstalled images, Jetson's limited NVML)
            # is no failure.
            if on_pci_bus(self.config.sysfs, NVIDIA_PCI_VENDOR, DISPLAY_CLASS):
                raise SourceUnavailable(str(err)) from None
            raise SourceAbsent(
                f"no NVIDIA GPU on the PCI bus ({self.config.sysfs}/bus/pci/devices); NVML: {err}"
            ) from None
        try:
            self.driver_version = text(pynvml.nvmlSystemGetDriverVersion)
            self.devices = [Device(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as err:
            pynvml.nvmlShutdown()
            raise SourceUnavailable(
                f"NVML cannot list devices: {err}; check `nvidia-smi` on the host"
            ) from None
        self.xids.start([device.index for device in self.devices])
        self.pid_namespace = pid_namespace_problem(self.config.procfs)
        if self.pid_namespace:
            log.warning("nvml: %s", self.pid_namespace)

    def stop(self) -> None:
        self.xids.stop()
        self.pcie.stop()
        for device in self.devices:
            device.gpm.close()
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.debug("nvmlShutdown: %s", err)

    def read(self) -> SourceReading:
        now = time.monotonic()
        self.xids.drain()
        gpus = tuple(self._read_device(device, now) for device in self.devices)
        self.pcie.start_round()
        return device_reading(gpus, "GPU")

    def describe(self, reading: SourceReading) -> str:
        models = sorted({gpu.model for gpu in reading.gpus})
        profiling = gpm.summary([(device.index, device.gpm) for device in self.devices])
        return (
            f"{len(reading.gpus)} GPU(s) {', '.join(models)}; driver {self.driver_version}"
            + profiling
            + unsupported_summary(self.devices, self.pcie.unsupported)
            + (f"; {self.pid_namespace}" if self.pid_namespace else "")
        )

    def _names(self, device: Device) -> dict[str, Any]:
        """The GpuReading fields that name the GPU: index, uuid, model, driver, PCI bus id."""
        return {
            "index": device.index,
            "uuid": device.uuid,
            "vendor": "nvidia",
            "model": device.model,
            "driver_version": self.driver_version,
            "pci_bus_id": device.pci_bus_id,
        }

    def _down(self, device: Device) -> GpuReading:
        return GpuReading(**self._names(device), up=False, error=device.error)

    def _read_device(self, device: Device, now: float) -> GpuReading:
        TURNS.give_way()
        if device.handle is None:
            if not device.retry.due(now):
                return self._down(device)
            try:
                _acquire(device)
                device.blank = {**BLANK_FIELDS, **self._names(device)}
                self.xids.watch(device.index, device.handle)
            except pynvml.NVMLError as err:
                device.fail(str(err), self.config.interval, now)
                return self._down(device)
        # Half an interval early, so sampling jitter never makes a read of the slow counters
        # wait a whole interval more.
        counter_period = self.config.nvml_counter_interval - self.config.interval / 2
        device.begin(now, self.config.nvml_reprobe_interval, counter_period)
        try:
            reading = self._values(device)
        except pynvml.NVMLError as err:
            return self._failed(device, str(err), now)
        if not device.answered:
            # Values NVML "cannot report" all at once: the GPU is failing, not a GPU without them.
            return self._failed(device, NOTHING_ANSWERED.format(index=device.index), now)
        device.error = ""
        device.retry.succeeded()
        return reading

    def _failed(self, device: Device, error: str, now: float) -> GpuReading:
        """The GPU failed this sample: down, its handle dropped, acquired again with backoff."""
        log.warning(
            "GPU %d: %s; retrying in %.0fs", device.index, error, max(device.retry.delay * 2, 1)
        )
        device.fail(error, self.config.interval, now)
        self.pcie.forget(device.index)
        self.xids.forget(device.index)
        return self._down(device)

    def _values(self, device: Device) -> GpuReading:
        """Every value of one GPU, each checked against its physical range."""
        # Filled in a copy of the GPU's blank fields, and the record made of that very dict: the
        # reading is made anew every sample, and a dict of some 60 fields copied once.
        fields = device.blank.copy()
        numbers = device.numbers(NUMBERS)
        fields.update(_number_fields(numbers))
        rates = device.record(
            "utilization", "nvmlDeviceGetUtilizationRates", pynvml.c_nvmlUtilization_t
        )
        if rates is not None:
            fields["utilization"] = ranges.ratio_from_percent(rates.gpu)
            fields["memory_utilization"] = ranges.ratio_from_percent(rates.memory)
        fields["throttled"] = _throttled(device, numbers[-1])
        xids = self.xids.counter.of(device.index)
        fields["xid_errors"] = xids.counts
        fields["last_xid_timestamp"] = xids.last_seen
        fields["last_xid_code"] = xids.last_code
        fields.update(_memory(device))
        fields.update(self.pcie.reading(device.index, device.handle, device.counters_due))
        fields["memory_temperature_celsius"] = _memory_temperature(device)
        fields.update(device.profiling())
        fields.update(reliability(device))
        add_mig(device, fields)  # first: a MIG parent's processes may be its MIG devices'
        fields["processes"] = gpu_processes(device, self.config.procfs)
        return made(GpuReading, fields)


def _acquire(device: Device) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
    device.uuid = text(pynvml.nvmlDeviceGetUUID, handle)
    device.model = text(pynvml.nvmlDeviceGetName, handle)
    device.pci_bus_id = decoded(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    device.unsupported.clear()
    device.gpm.open(handle)
    device.handle = handle


def _memory(device: Device) -> dict[str, int | None]:
    """GpuReading fields of total, used, free and reserved memory bytes (reserved from the v2 call
    only); each but the total only where it fits in the total."""
    info = device.record("memory_v2", "nvmlDeviceGetMemoryInfo_v2", _memory_v2)
    if info is None:
        info = device.query("memory", pynvml.nvmlDeviceGetMemoryInfo, device.handle)
    total = None if info is None else ranges.byte_count(info.total)
    if info is None or total is None:
        return {}

    def part(value: int | None) -> int | None:
        count = ranges.byte_count(value)
        return count if count is not None and count <= total else None

    return {
        "memory_used_bytes": part(info.used),
        "memory_total_bytes": total,
        "memory_free_bytes": part(info.free),
        "memory_reserved_bytes": part(getattr(info, "reserved", None)),
    }


def _memory_v2() -> pynvml.c_nvmlMemory_v2_t:
    info = pynvml.c_nvmlMemory_v2_t()
    info.version = pynvml.nvmlMemory_v2
    return info


def _memory_temperature_field() -> pynvml.c_nvmlFieldValue_t:
    field = pynvml.c_nvmlFieldValue_t()
    field.fieldId = pynvml.NVML_FI_DEV_MEMORY_TEMP
    return field


def _memory_temperature(device: Device) -> float | None:
    value = device.record(
        "memory_temperature", "nvmlDeviceGetFieldValues", _memory_temperature_field, 1
    )
    if value is None:
        return None
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        device.cannot("memory_temperature")
        return None
    return ranges.celsius(float(value.value.uiVal))


def _number_fields(numbers: list[Any]) -> dict[str, Any]:
    """GpuReading fields of the numbers read by NUMBERS, in its order, in their units and
    ranges."""
    encoder, decoder, power, limit, energy, sm, memory, fan, pstate, celsius, _ = numbers
    return {
        "encoder_utilization": ranges.ratio_from_percent(encoder),
        "decoder_utilization": ranges.ratio_from_percent(decoder),
        "power_watts": ranges.watts(power / 1000 if power is not None else None),
        "power_limit_watts": ranges.watts(limit / 1000 if limit is not None else None),
        "energy_joules": energy / 1000 if energy is not None and energy < 2**63 else None,
        "sm_clock_hertz": ranges.hertz(sm * 1e6 if sm is not None else None),
        "memory_clock_hertz": ranges.hertz(memory * 1e6 if memory is not None else None),
        "fan_speed_ratio": ranges.fan_ratio_from_percent(fan),
        "performance_state": pstate if pstate is not None and 0 <= pstate <= 15 else None,
        "temperature_celsius": ranges.celsius(celsius),
    }


def _throttled(device: Device, mask: int | None) -> tuple[tuple[str, bool], ...]:
    """The clocks event reasons of `mask` (NUMBERS' last), asked by their old name where the
    driver lacks the new."""
    if mask is None:
        (mask,) = device.numbers(THROTTLE_REASONS_GETTER)
    if mask is None or mask >= 1 << 32:
        return ()
    return _reasons(mask)


@functools.lru_cache(maxsize=64)
def _reasons(mask: int) -> tuple[tuple[str, bool], ...]:
    """(reason, whether it holds the clocks down) for each bit of a clocks event mask; the same
    tuple for the same mask, which is mostly the same from one sample to the next."""
    return tuple((name, bool(mask & bit)) for bit, name in THROTTLE_REASONS)
