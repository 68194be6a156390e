"""The reliability and link series of an accelerator: NVLinks, remapped rows, retired pages, PCIe
replays and clock-event time."""

from __future__ import annotations

from typing import Iterator

from kepler_bridge.model import GpuReading

# Exposed name -> (type, labels beyond the device's), in the order of the exposition.
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu_nvlink_up": ("gauge", ("link",)),
    "gpu_nvlink_transmit_bytes_total": ("counter", ("link",)),
    "gpu_nvlink_receive_bytes_total": ("counter", ("link",)),
    "gpu_nvlink_errors_total": ("counter", ("link", "kind")),
    "gpu_remapped_rows_total": ("counter", ("cause",)),
    "gpu_retired_pages_total": ("counter", ("cause",)),
    "gpu_pcie_replays_total": ("counter", ()),
    "gpu_clock_event_seconds_total": ("counter", ("reason",)),
}

Series = tuple[str, list[str], float]


def series(gpu: GpuReading) -> Iterator[Series]:
    """Each series of a device that is up: its family, its labels beyond the device's, its value;
    none for a value the device cannot report."""
    for link in gpu.nvlinks:
        number = str(link.link)
        yield "gpu_nvlink_up", [number], 1.0 if link.up else 0.0
        if link.transmit_bytes is not None:
            yield "gpu_nvlink_transmit_bytes_total", [number], float(link.transmit_bytes)
        if link.receive_bytes is not None:
            yield "gpu_nvlink_receive_bytes_total", [number], float(link.receive_bytes)
        for kind, count in link.errors:
            yield "gpu_nvlink_errors_total", [number, kind], float(count)
    yield from _counts(
        gpu,
        (
            ("gpu_remapped_rows_total", "correctable", gpu.remapped_rows_correctable),
            ("gpu_remapped_rows_total", "uncorrectable", gpu.remapped_rows_uncorrectable),
            ("gpu_retired_pages_total", "single_bit", gpu.retired_pages_single_bit),
            ("gpu_retired_pages_total", "double_bit", gpu.retired_pages_double_bit),
        ),
    )
    if gpu.pcie_replays is not None:
        yield "gpu_pcie_replays_total", [], float(gpu.pcie_replays)
    for reason, seconds in gpu.clock_event_seconds:
        yield "gpu_clock_event_seconds_total", [reason], seconds


def _counts(gpu: GpuReading, rows: tuple[tuple[str, str, int | None], ...]) -> Iterator[Series]:
    return ((name, [cause], float(count)) for name, cause, count in rows if count is not None)
