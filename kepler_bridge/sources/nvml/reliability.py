"""A GPU's slow counters: ECC errors, remapped rows, retired pages, PCIe replays and clock-event
time, read once per --nvml-counter-interval; and its NVLinks."""

from __future__ import annotations

from typing import Any

import pynvml

from kepler_bridge.sources.nvml.device import Device
from kepler_bridge.sources.nvml.links import nvlinks

# nvmlDeviceGetViolationStatus's policies, named as the gpu_clock_event_seconds_total reasons.
CLOCK_EVENT_REASONS = (
    (pynvml.NVML_PERF_POLICY_POWER, "power"),
    (pynvml.NVML_PERF_POLICY_THERMAL, "thermal"),
    (pynvml.NVML_PERF_POLICY_SYNC_BOOST, "sync_boost"),
    (pynvml.NVML_PERF_POLICY_BOARD_LIMIT, "board_limit"),
    (pynvml.NVML_PERF_POLICY_LOW_UTILIZATION, "low_utilization"),
    (pynvml.NVML_PERF_POLICY_RELIABILITY, "reliability"),
)
# What NVML gives in an unsigned int it cannot fill (N/A), not a count; in an unsigned long long
# that is 2**64 - 1, beyond the 2**63 no count of NVML's reaches.
NOT_AVAILABLE_UINT = 2**32 - 1
RETIREMENT_CAUSES = (
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
)


def reliability(device: Device) -> dict[str, Any]:
    """GpuReading fields of the GPU's NVLinks and slow counters: the counters read in the samples
    `Device.begin` marks due, their last values in between; absent where the GPU cannot report
    them."""
    if device.counters_due or device.counters is None:
        device.counters = {**_memory_errors(device), **_pcie_and_clocks(device)}
    return {"nvlinks": nvlinks(device), **device.counters}


def _memory_errors(device: Device) -> dict[str, Any]:
    """ECC errors, remapped rows and retired pages."""
    h = device.handle
    rows = device.query("remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
    single, double = (
        device.query(f"retired_pages{cause}", pynvml.nvmlDeviceGetRetiredPages, h, cause)
        for cause in RETIREMENT_CAUSES
    )
    pending = device.query(
        "retired_pages_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h
    )
    return {
        "ecc_corrected_total": _ecc(device, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        "ecc_uncorrected_total": _ecc(device, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        "remapped_rows_correctable": _count(rows[0]) if rows else None,
        "remapped_rows_uncorrectable": _count(rows[1]) if rows else None,
        "row_remap_pending": bool(rows[2]) if rows else None,
        "row_remap_failed": bool(rows[3]) if rows else None,
        "retired_pages_single_bit": None if single is None else len(single),
        "retired_pages_double_bit": None if double is None else len(double),
        "retired_pages_pending": (
            None if pending is None else pending == pynvml.NVML_FEATURE_ENABLED
        ),
    }


def _ecc(device: Device, kind: int) -> int | None:
    count = device.query(
        f"ecc{kind}",
        pynvml.nvmlDeviceGetTotalEccErrors,
        device.handle,
        kind,
        pynvml.NVML_VOLATILE_ECC,
    )
    return count if count is not None and count < 2**63 else None


def _count(value: int | None) -> int | None:
    """An unsigned int counter of NVML's; None for its N/A."""
    return None if value is None or value >= NOT_AVAILABLE_UINT else value


def _pcie_and_clocks(device: Device) -> dict[str, Any]:
    """PCIe replays, and the seconds the clocks were held down for each reason since the driver
    loaded."""
    times = (
        (
            reason,
            device.query(
                f"violation{policy}", pynvml.nvmlDeviceGetViolationStatus, device.handle, policy
            ),
        )
        for policy, reason in CLOCK_EVENT_REASONS
    )
    return {
        "pcie_replays": _count(
            device.query("pcie_replays", pynvml.nvmlDeviceGetPcieReplayCounter, device.handle)
        ),
        "clock_event_seconds": tuple(
            (reason, time.violationTime / 1e9)
            for reason, time in times
            if time is not None and time.violationTime < 2**63
        ),
    }
