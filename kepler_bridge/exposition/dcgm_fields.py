"""dcgm-exporter's fields: each one's name, type and help as dcgm-exporter declares them, and how
its value in DCGM's unit comes from a reading (exposition/dcgm.py renders them)."""

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


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter field: its name, its type as dcgm-exporter declares it, help, and how
    its value in DCGM's unit comes from a reading (None: the device does not report it)."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    read: Reader


def scaled(attribute: str, scale: float = 1.0, whole: Rounding | None = round) -> Reader:
    """Reads `attribute` (our unit) times `scale` (DCGM's unit), made a whole number as DCGM's
    integer fields are; `whole=None` for DCGM's floating-point fields."""

    def read(gpu: GpuReading) -> float | None:
        value = getattr(gpu, attribute)
        if value is None:
            return None
        value = float(value) * scale
        return float(whole(value)) if whole is not None else value

    return read


# In the order of the exposition. A new reading field gets one row here (and one in docs/design.md,
# "dcgm-exporter names").
FIELDS: tuple[Field, ...] = (
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
)
