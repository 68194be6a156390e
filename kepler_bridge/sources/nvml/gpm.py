"""GPM profiling metrics (NVIDIA Hopper and newer): one sample per GPU each interval, and the
metrics between the last two in the contract's units."""

from __future__ import annotations

import logging
from typing import Any

import pynvml

from kepler_bridge.sources import ranges

log = logging.getLogger(__name__)

MIB = 1024 * 1024
UNSUPPORTED_REASON = "GPM not supported (needs Hopper or newer)"
# Answers meaning this GPU or driver has no GPM at all.
NO_GPM = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

# GpuReading field -> GPM metric id, in percent.
RATIOS = {
    "sm_active": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "graphics_active": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "tensor_active": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_active": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}
# GpuReading field -> GPM metric id, in MiB/s.
BANDWIDTHS = {
    "profiled_pcie_transmit_bytes_per_second": pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    "profiled_pcie_receive_bytes_per_second": pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    "profiled_nvlink_transmit_bytes_per_second": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    "profiled_nvlink_receive_bytes_per_second": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
}
# `pipe` label -> GPM metric id, in percent.
PIPES = {
    "tensor_hmma": pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL,
    "tensor_imma": pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL,
    "tensor_dfma": pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL,
    "fp64": pynvml.NVML_GPM_METRIC_FP64_UTIL,
    "fp32": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "fp16": pynvml.NVML_GPM_METRIC_FP16_UTIL,
    "integer": pynvml.NVML_GPM_METRIC_INTEGER_UTIL,
}
# `engine` label -> the GPM metric ids of its instances, in percent.
ENGINES = {
    "nvdec": tuple(
        range(pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL, pynvml.NVML_GPM_METRIC_NVDEC_7_UTIL + 1)
    ),
    "nvjpg": tuple(
        range(pynvml.NVML_GPM_METRIC_NVJPG_0_UTIL, pynvml.NVML_GPM_METRIC_NVJPG_7_UTIL + 1)
    ),
    "nvofa": (pynvml.NVML_GPM_METRIC_NVOFA_0_UTIL, pynvml.NVML_GPM_METRIC_NVOFA_1_UTIL),
}
METRIC_IDS = (
    *RATIOS.values(),
    *BANDWIDTHS.values(),
    *PIPES.values(),
    *(metric for instances in ENGINES.values() for metric in instances),
)


class Gpm:
    """One GPU's GPM state: its two samples (the last one taken, and a spare), how many were taken
    in a row, whether sampling fails, and why the GPU has no GPM."""

    def __init__(self) -> None:
        self.samples: list[Any] = []
        self.taken = 0
        self.failing = False  # the last sample failed (logged once)
        self.reason = ""

    def open(self, handle: Any) -> None:
        """At GPU acquire: ask whether the GPU has GPM and allocate the two samples it needs.

        No GPM sets `reason`; other NVML errors raise, and the GPU is acquired again later."""
        self.close()
        self.reason = ""
        try:
            if not pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                self.reason = UNSUPPORTED_REASON
                return
            for _ in range(2):
                self.samples.append(pynvml.nvmlGpmSampleAlloc())
        except pynvml.NVMLError as err:
            self.close()
            if err.value not in NO_GPM:
                raise
            self.reason = _no_gpm(err)

    def read(self, handle: Any, index: int) -> dict[str, Any]:
        """Take this interval's sample: the metrics since the last one, as GpuReading fields.

        None in a GPU's first interval, after a failed sample and without GPM. A lost GPU raises."""
        if not self.samples:
            return {}
        last, spare = self.samples
        try:
            pynvml.nvmlGpmSampleGet(handle, spare)
        except pynvml.NVMLError as err:
            self.taken = 0
            if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            if err.value in NO_GPM:
                self.close()
                self.reason = _no_gpm(err)
            elif not self.failing:
                log.warning("GPU %d: GPM samples fail: %s; profiling metrics left out", index, err)
            self.failing = True
            return {}
        self.failing = False
        self.samples = [spare, last]
        self.taken += 1
        return _between(last, spare, index) if self.taken >= 2 else {}

    def close(self) -> None:
        """Free the samples: when the source stops and when the GPU is lost."""
        for sample in self.samples:
            try:
                pynvml.nvmlGpmSampleFree(sample)
            except pynvml.NVMLError as err:
                log.debug("nvmlGpmSampleFree: %s", err)
        self.samples = []
        self.taken = 0


def _no_gpm(err: pynvml.NVMLError) -> str:
    """Why a GPU has no GPM, from NVML's answer."""
    if err.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return "GPM missing from this driver's NVML: update the NVIDIA driver"
    return UNSUPPORTED_REASON


def _between(first: Any, second: Any, index: int) -> dict[str, Any]:
    """The GpuReading fields GPM reports between two samples of a GPU; none when the call fails."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(METRIC_IDS)
    request.sample1, request.sample2 = first, second
    for n, metric in enumerate(METRIC_IDS):
        request.metrics[n].metricId = metric
    try:
        pynvml.nvmlGpmMetricsGet(request)
    except pynvml.NVMLError as err:
        log.warning("GPU %d: GPM metrics failed: %s", index, err)
        return {}
    return fields(
        {
            metric.metricId: metric.value
            for metric in request.metrics[: len(METRIC_IDS)]
            if metric.nvmlReturn == pynvml.NVML_SUCCESS
        }
    )


def fields(values: dict[int, float]) -> dict[str, Any]:
    """GpuReading fields from GPM values by metric id (percent, MiB/s); a missing one is None."""
    found: dict[str, Any] = {
        name: ranges.ratio_from_percent(values.get(metric)) for name, metric in RATIOS.items()
    }
    for name, metric in BANDWIDTHS.items():
        mib = values.get(metric)
        found[name] = ranges.bounded(
            None if mib is None else mib * MIB, 0, ranges.MAX_BYTES_PER_SECOND
        )
    found["pipe_active"] = _ratios({pipe: values.get(metric) for pipe, metric in PIPES.items()})
    found["engine_active"] = _ratios(
        {engine: _mean(values, instances) for engine, instances in ENGINES.items()}
    )
    return found


def _mean(values: dict[int, float], metrics: tuple[int, ...]) -> float | None:
    """The mean of the metrics GPM reported; None when it reported none of them."""
    reported = [values[metric] for metric in metrics if metric in values]
    return sum(reported) / len(reported) if reported else None


def _ratios(percents: dict[str, float | None]) -> tuple[tuple[str, float], ...]:
    """(label, ratio) for each percentage that is reported and within 0..100."""
    pairs = ((label, ranges.ratio_from_percent(percent)) for label, percent in percents.items())
    return tuple((label, ratio) for label, ratio in pairs if ratio is not None)


def summary(devices: list[tuple[int, Gpm]]) -> str:
    """For `doctor`: which GPUs have GPM profiling, and why the others have none."""
    on = [str(index) for index, gpm in devices if gpm.samples]
    off: dict[str, list[str]] = {}
    for index, gpm in devices:
        if gpm.reason:
            off.setdefault(gpm.reason, []).append(str(index))
    parts = [f"GPM profiling on GPU {', '.join(on)}"] if on else []
    parts += [f"no profiling metrics on GPU {', '.join(ids)}: {why}" for why, ids in off.items()]
    return "".join(f"; {part}" for part in parts)
