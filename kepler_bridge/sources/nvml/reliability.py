"""A GPU's reliability counters: remapped rows, retired pages, PCIe replays, clock-event time,
and its NVLinks."""

from __future__ import annotations

import dataclasses

import pynvml

from kepler_bridge.model import GpuReading
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
RETIREMENT_CAUSES = (
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
)


def with_reliability(device: Device, reading: GpuReading) -> GpuReading:
    """The reading with the GPU's reliability counters and NVLinks added; absent where the GPU
    cannot report them."""
    h = device.handle
    rows = device.query("remapped_rows", lambda: pynvml.nvmlDeviceGetRemappedRows(h))
    single, double = (
        device.query(f"retired_pages{cause}", lambda: pynvml.nvmlDeviceGetRetiredPages(h, cause))
        for cause in RETIREMENT_CAUSES
    )
    pending = device.query(
        "retired_pages_pending", lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    )
    return dataclasses.replace(
        reading,
        nvlinks=nvlinks(device),
        remapped_rows_correctable=rows[0] if rows else None,
        remapped_rows_uncorrectable=rows[1] if rows else None,
        row_remap_pending=bool(rows[2]) if rows else None,
        row_remap_failed=bool(rows[3]) if rows else None,
        retired_pages_single_bit=None if single is None else len(single),
        retired_pages_double_bit=None if double is None else len(double),
        retired_pages_pending=None if pending is None else pending == pynvml.NVML_FEATURE_ENABLED,
        pcie_replays=device.query("pcie_replays", lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h)),
        clock_event_seconds=_clock_events(device),
    )


def _clock_events(device: Device) -> tuple[tuple[str, float], ...]:
    """Seconds the clocks were held down for each reason since the driver loaded."""
    times = (
        (
            reason,
            device.query(
                f"violation{policy}",
                lambda: pynvml.nvmlDeviceGetViolationStatus(device.handle, policy),
            ),
        )
        for policy, reason in CLOCK_EVENT_REASONS
    )
    return tuple((reason, time.violationTime / 1e9) for reason, time in times if time is not None)
