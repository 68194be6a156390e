"""dcgm-exporter's fields: `Field`, the readers that give a field's value in DCGM's unit from a
reading, and the device fields (DCGM_FI_DEV_*); exposition/dcgm.py renders them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kepler_bridge.model import GpuReading

Reader = Callable[[GpuReading], "float | None"]
Rounding = Callable[[float], int]

PERCENT = 100.0  # our ratios 0..1 -> DCGM's percent 0..100
MHZ = 1e-6
MIB = 2.0**-20
KIB = 2.0**-10  # NVML's PCIe "KB" are 1024 bytes (sources/nvml/source.py multiplies by 1024)
MILLI = 1e3  # joules -> millijoules
NANO = 1e9  # seconds -> nanoseconds (DCGM's violation times are ns, as NVML's)
# DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL is a rate of all links in both directions, as GPM measures it.
NVLINK_PROFILED = (
    "profiled_nvlink_transmit_bytes_per_second",
    "profiled_nvlink_receive_bytes_per_second",
)


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter field: its name, its type as dcgm-exporter declares it, help, and how
    its value in DCGM's unit comes from a reading (None: the device does not report it)."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    read: Reader


def _in_unit(value: float | None, scale: float, whole: Rounding | None) -> float | None:
    """`value` (our unit) times `scale` (DCGM's unit), made a whole number as DCGM's integer
    fields are; `whole=None` for DCGM's floating-point fields."""
    if value is None:
        return None
    value = float(value) * scale
    return float(whole(value)) if whole is not None else value


def scaled(attribute: str, scale: float = 1.0, whole: Rounding | None = round) -> Reader:
    """Reads the reading's `attribute` in DCGM's unit."""
    return lambda gpu: _in_unit(getattr(gpu, attribute), scale, whole)


def keyed(attribute: str, key: str, scale: float = 1.0, whole: Rounding | None = round) -> Reader:
    """Reads the value named `key` of the reading's (name, value) pairs `attribute`."""
    return lambda gpu: _in_unit(dict(getattr(gpu, attribute)).get(key), scale, whole)


def summed(attributes: tuple[str, ...], scale: float = 1.0) -> Reader:
    """Reads the sum of the reading's `attributes`, absent unless it reports them all."""

    def read(gpu: GpuReading) -> float | None:
        values = [getattr(gpu, attribute) for attribute in attributes]
        return None if None in values else _in_unit(sum(values), scale, round)

    return read


def link_errors(kind: str) -> Reader:
    """Reads the errors of `kind` summed over the NVLinks that count them (DCGM's _TOTAL)."""

    def read(gpu: GpuReading) -> float | None:
        counts = [count for link in gpu.nvlinks for name, count in link.errors if name == kind]
        return float(sum(counts)) if counts else None

    return read


# The device fields (DCGM_FI_DEV_*), in the order of the exposition; the profiling fields are in
# exposition/dcgm_profiling.py. A new reading field gets one row in one of them (and one in
# docs/design.md, "dcgm-exporter names").
DEVICE: tuple[Field, ...] = (
    Field(
        "DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", scaled("utilization", PERCENT)
    ),
    Field(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory utilization (in %).",
        scaled("memory_utilization", PERCENT),
    ),
    Field(
        "DCGM_FI_DEV_ENC_UTIL",
        "gauge",
        "Encoder utilization (in %).",
        scaled("encoder_utilization", PERCENT),
    ),
    Field(
        "DCGM_FI_DEV_DEC_UTIL",
        "gauge",
        "Decoder utilization (in %).",
        scaled("decoder_utilization", PERCENT),
    ),
    Field(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        scaled("memory_used_bytes", MIB, math.floor),
    ),
    Field(
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
        scaled("memory_free_bytes", MIB, math.floor),
    ),
    Field(
        "DCGM_FI_DEV_FB_TOTAL",
        "gauge",
        "Framebuffer memory size (in MiB).",
        scaled("memory_total_bytes", MIB, math.floor),
    ),
    Field(
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory reserved (in MiB).",
        scaled("memory_reserved_bytes", MIB, math.floor),
    ),
    Field(
        "DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", scaled("temperature_celsius")
    ),
    Field(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "gauge",
        "Memory temperature (in C).",
        scaled("memory_temperature_celsius"),
    ),
    Field(
        "DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", scaled("power_watts", whole=None)
    ),
    Field(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        "gauge",
        "Enforced power limit (in W).",
        scaled("power_limit_watts", whole=None),
    ),
    Field(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption (in mJ).",
        scaled("energy_joules", MILLI),
    ),
    Field(
        "DCGM_FI_DEV_SM_CLOCK",
        "gauge",
        "SM clock frequency (in MHz).",
        scaled("sm_clock_hertz", MHZ),
    ),
    Field(
        "DCGM_FI_DEV_MEM_CLOCK",
        "gauge",
        "Memory clock frequency (in MHz).",
        scaled("memory_clock_hertz", MHZ),
    ),
    Field(
        "DCGM_FI_DEV_FAN_SPEED",
        "gauge",
        "Fan speed (in % of its maximum).",
        scaled("fan_speed_ratio", PERCENT),
    ),
    Field(
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "counter",
        "PCIe transmit throughput (in KB/s) via NVML.",
        scaled("pcie_transmit_bytes_per_second", KIB),
    ),
    Field(
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "counter",
        "PCIe receive throughput (in KB/s) via NVML.",
        scaled("pcie_receive_bytes_per_second", KIB),
    ),
    Field(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
        scaled("pcie_replays"),
    ),
    Field(
        "DCGM_FI_DEV_PSTATE",
        "gauge",
        "Performance state (P-State) 0-15, 0 the highest.",
        scaled("performance_state"),
    ),
    Field(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Single-bit (corrected) volatile ECC errors.",
        scaled("ecc_corrected_total"),
    ),
    Field(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Double-bit (uncorrected) volatile ECC errors.",
        scaled("ecc_uncorrected_total"),
    ),
    Field(
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error seen.",
        scaled("last_xid_code"),
    ),
    Field(
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in ns).",
        keyed("clock_event_seconds", "power", NANO),
    ),
    Field(
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in ns).",
        keyed("clock_event_seconds", "thermal", NANO),
    ),
    Field(
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "counter",
        "Throttling duration due to sync-boost constraints (in ns).",
        keyed("clock_event_seconds", "sync_boost", NANO),
    ),
    Field(
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
        "counter",
        "Throttling duration due to board limit constraints (in ns).",
        keyed("clock_event_seconds", "board_limit", NANO),
    ),
    Field(
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
        "counter",
        "Throttling duration due to low utilization (in ns).",
        keyed("clock_event_seconds", "low_utilization", NANO),
    ),
    Field(
        "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "counter",
        "Throttling duration due to reliability constraints (in ns).",
        keyed("clock_event_seconds", "reliability", NANO),
    ),
    Field(
        "DCGM_FI_DEV_RETIRED_SBE",
        "counter",
        "Total number of retired pages due to single-bit errors.",
        scaled("retired_pages_single_bit"),
    ),
    Field(
        "DCGM_FI_DEV_RETIRED_DBE",
        "counter",
        "Total number of retired pages due to double-bit errors.",
        scaled("retired_pages_double_bit"),
    ),
    Field(
        "DCGM_FI_DEV_RETIRED_PENDING",
        "counter",
        "Whether pages are pending retirement (1) or not (0).",
        scaled("retired_pages_pending"),
    ),
    Field(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors.",
        scaled("remapped_rows_uncorrectable"),
    ),
    Field(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors.",
        scaled("remapped_rows_correctable"),
    ),
    Field(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed.",
        scaled("row_remap_failed"),
    ),
    Field(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "gauge",
        "Whether remapping of rows is pending.",
        scaled("row_remap_pending"),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        link_errors("crc_flit"),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink data CRC errors.",
        link_errors("crc_data"),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
        link_errors("replay"),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
        link_errors("recovery"),
    ),
    Field(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "NVLink throughput of all links, transmit and receive (in MiB/s).",
        summed(NVLINK_PROFILED, MIB),
    ),
)
