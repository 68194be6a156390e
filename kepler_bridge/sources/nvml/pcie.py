"""PCIe throughput of NVIDIA GPUs, measured in a thread of its own: NVML's call waits 20 ms while
it measures the link, 40 ms a GPU for both directions, which no sample should wait for."""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import pynvml

from kepler_bridge.sources import ranges
from kepler_bridge.sources.nvml.device import UNSUPPORTED

log = logging.getLogger(__name__)

# (name in `doctor`'s "cannot report", GpuReading field, NVML counter) of each direction.
DIRECTIONS = (
    ("pcie_tx", "pcie_transmit_bytes_per_second", pynvml.NVML_PCIE_UTIL_TX_BYTES),
    ("pcie_rx", "pcie_receive_bytes_per_second", pynvml.NVML_PCIE_UTIL_RX_BYTES),
)
# How long `stop` waits for a round to end before NVML is shut down under it: a round takes
# 40 ms a GPU on a working driver.
STOP_WAIT_SECONDS = 2.0


class PcieThroughput:
    """The last PCIe throughput measured of each GPU. The GPUs `reading` is told are due are
    measured in a round in a thread (`kepler-bridge-nvml-pcie`) that `start_round` starts unless
    one runs; a GPU never measured yet is measured at once, so its first reading has its values."""

    def __init__(self) -> None:
        self._values: dict[int, dict[str, float | None]] = {}  # GPU index -> GpuReading fields
        # GPU index -> the directions its last measurement said it cannot report.
        self._unsupported: dict[int, tuple[str, ...]] = {}
        self._due: list[tuple[int, Any]] = []
        self._round: threading.Thread | None = None

    def reading(self, index: int, handle: Any, due: bool) -> dict[str, float | None]:
        """The GpuReading fields of the GPU's last measurement; `due`: measure it again."""
        values = self._values.get(index)
        if values is None:
            self._measure([(index, handle)], True)
            return self._values[index]
        if due:
            self._due.append((index, handle))
        return values

    def start_round(self) -> None:
        """Measure the GPUs found due since the last round, in a thread, unless a round runs."""
        due, self._due = self._due, []
        if due and (self._round is None or not self._round.is_alive()):
            self._round = threading.Thread(
                target=self._measure, args=(due, False), name="kepler-bridge-nvml-pcie", daemon=True
            )
            self._round.start()

    def unsupported(self, index: int) -> tuple[str, ...]:
        """The directions the GPU's last measurement said it cannot report (for `doctor`)."""
        return self._unsupported.get(index, ())

    def forget(self, index: int) -> None:
        """Drop a GPU's values (it went down): measured again at its first reading back."""
        self._values.pop(index, None)
        self._unsupported.pop(index, None)

    def stop(self) -> None:
        """Wait for a round in progress, so NVML is not shut down under its call."""
        if self._round is not None:
            self._round.join(STOP_WAIT_SECONDS)
            if self._round.is_alive():
                log.warning(
                    "nvml: a PCIe throughput call did not return in %.0f s", STOP_WAIT_SECONDS
                )

    def _measure(self, gpus: list[tuple[int, Any]], new: bool) -> None:
        """Measure each GPU and keep its values; a round (`new` false) keeps none of a GPU
        forgotten meanwhile, which is measured afresh when it is back."""
        try:
            call = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetPcieThroughput")
        except pynvml.NVMLError:  # a driver without it
            call = None
        kib = ctypes.c_uint()
        for index, handle in gpus:
            values: dict[str, float | None] = {}
            unsupported = []
            for name, field, counter in DIRECTIONS:
                result = call(handle, counter, ctypes.byref(kib)) if call is not None else None
                ok = result == pynvml.NVML_SUCCESS
                values[field] = _bytes_per_second(kib.value) if ok else None
                if result is None or result in UNSUPPORTED:
                    unsupported.append(name)
            if new or index in self._values:
                self._values[index] = values
                self._unsupported[index] = tuple(unsupported)


def _bytes_per_second(kib: int) -> float | None:
    """PCIe throughput, which NVML gives in KiB/s."""
    return ranges.bounded(kib * 1024, 0, ranges.MAX_BYTES_PER_SECOND)
