"""GPM profiling metrics (NVIDIA Hopper and newer): one sample per GPU, and per MIG GPU instance
(`nvmlGpmMigSampleGet`), each interval, and the metrics between the last two in the contract's
units."""

from __future__ import annotations

import logging
from typing import Any, Callable

import pynvml

from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Retry

log = logging.getLogger(__name__)

MIB = 1024 * 1024
UNSUPPORTED_REASON = "GPM not supported (needs Hopper or newer)"
# Answers meaning this GPU or driver has no GPM at all, or gives it to administrators only.
NO_GPM = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
)
# Answers of nvmlGpmMigSampleGet for a GPU instance destroyed since it was listed.
GONE = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)

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
# A GPU instance reports the RATIOS (MigInstance has a field of each name).
INSTANCE_METRIC_IDS = tuple(RATIOS.values())
METRIC_IDS = (
    *RATIOS.values(),
    *BANDWIDTHS.values(),
    *PIPES.values(),
    *(metric for instances in ENGINES.values() for metric in instances),
)


class _Pair:
    """Two GPM samples of a GPU or GPU instance (the last one taken, and a spare), and how many
    were taken in a row."""

    def __init__(self) -> None:
        self.samples: list[Any] = []
        self.taken = 0
        try:
            for _ in range(2):
                self.samples.append(pynvml.nvmlGpmSampleAlloc())
        except pynvml.NVMLError:
            self.free()
            raise

    def take(self, get: Callable[[Any], object]) -> tuple[Any, Any] | None:
        """Fill the spare with `get`: the last two samples when they follow each other, else None.

        NVMLError raises, and the next sample starts a new run."""
        last, spare = self.samples
        try:
            get(spare)
        except pynvml.NVMLError:
            self.taken = 0
            raise
        self.samples = [spare, last]
        self.taken += 1
        return (last, spare) if self.taken >= 2 else None

    def free(self) -> None:
        """Free both samples."""
        for sample in self.samples:
            try:
                pynvml.nvmlGpmSampleFree(sample)
            except pynvml.NVMLError as err:
                log.debug("nvmlGpmSampleFree: %s", err)
        self.samples = []
        self.taken = 0


class Gpm:
    """One GPU's GPM state: its samples, those of its MIG GPU instances (by GPU instance id),
    whether sampling fails, and why the GPU has no GPM."""

    def __init__(self) -> None:
        self.pair: _Pair | None = None
        self.instances: dict[int, _Pair] = {}
        self.failing = False  # the last sample failed (logged once)
        self.mig_unsupported = False  # nvmlGpmMigSampleGet is not supported: asked again rarely
        self.reason = ""
        self.retry = Retry(0.0)  # when to ask again what GPM said it cannot do

    def reprobe(self, handle: Any, now: float, interval: float, cap: float) -> None:
        """Where GPM said it cannot sample this GPU or its GPU instances, ask again when due:
        after `interval` s, doubling while it still cannot, up to `cap` s."""
        if not (self.reason or self.mig_unsupported):
            return
        # Just given up (nothing scheduled since GPM last worked): first ask again after one wait.
        scheduled = self.retry.delay > 0
        if scheduled and not self.retry.due(now):
            return
        self.retry.cap = cap
        self.retry.failed(interval, now)
        if not scheduled:
            return
        if self.reason:
            self.open(handle)
        self.mig_unsupported = False

    def open(self, handle: Any) -> None:
        """At GPU acquire: ask whether the GPU has GPM and allocate the two samples it needs.

        No GPM, or any failure but a lost GPU's, sets `reason` (profiling is an extra: the GPU is
        read without it, and asked again when due); a lost GPU raises."""
        self.close()
        self.reason = ""
        try:
            if not pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                self.reason = UNSUPPORTED_REASON
                return
            self.pair = _Pair()
            self.retry.succeeded()
        except pynvml.NVMLError as err:
            self.close()
            if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            self.reason = _no_gpm(err)

    def read(self, handle: Any, index: int) -> dict[str, Any]:
        """Take this interval's sample: the metrics since the last one, as GpuReading fields.

        None in a GPU's first interval, after a failed sample and without GPM. A lost GPU raises."""
        if self.pair is None:
            return {}
        try:
            pair = self.pair.take(lambda sample: pynvml.nvmlGpmSampleGet(handle, sample))
        except pynvml.NVMLError as err:
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
        if pair is None:
            return {}
        return fields(_metrics(*pair, METRIC_IDS, f"GPU {index}"))

    def read_instances(self, handle: Any, gpu_instances: set[int], index: int) -> dict[int, Any]:
        """This interval's sample of each GPU instance: GPU instance id -> its MigInstance fields.

        The samples of a GPU instance not listed (destroyed, MIG mode off) are freed."""
        for gone in set(self.instances) - gpu_instances:
            self.instances.pop(gone).free()
        if self.pair is None or self.mig_unsupported:
            return {}
        found = {}
        for gpu_instance in sorted(gpu_instances):
            if self.mig_unsupported:
                return {}
            pair = self._instance_pair(handle, gpu_instance)
            if pair is not None:
                what = f"GPU {index} instance {gpu_instance}"
                values = _metrics(*pair, INSTANCE_METRIC_IDS, what)
                found[gpu_instance] = instance_fields(values)
        return found

    def _instance_pair(self, handle: Any, gpu_instance: int) -> tuple[Any, Any] | None:
        """Sample one GPU instance; its last two samples when they follow each other."""
        try:
            if gpu_instance not in self.instances:
                self.instances[gpu_instance] = _Pair()
            pair = self.instances[gpu_instance].take(
                lambda sample: pynvml.nvmlGpmMigSampleGet(handle, gpu_instance, sample)
            )
            self.retry.succeeded()
            return pair
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            if err.value in NO_GPM:
                self.mig_unsupported = True
                self._free_instances()
            elif err.value in GONE and gpu_instance in self.instances:
                self.instances.pop(gpu_instance).free()  # destroyed since it was listed
            else:
                log.debug("GPU instance %d: GPM sample failed: %s", gpu_instance, err)
            return None

    def close(self) -> None:
        """Free every sample: when the source stops and when the GPU is lost."""
        if self.pair is not None:
            self.pair.free()
        self.pair = None
        self._free_instances()
        self.mig_unsupported = False

    def _free_instances(self) -> None:
        for pair in self.instances.values():
            pair.free()
        self.instances = {}


def _no_gpm(err: pynvml.NVMLError) -> str:
    """Why a GPU has no GPM, from NVML's answer."""
    if err.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return "GPM missing from this driver's NVML: update the NVIDIA driver"
    if err.value == pynvml.NVML_ERROR_NO_PERMISSION:
        return (
            "GPM refused (no permission): the driver gives profiling to administrators only; run "
            "the agent as root, or load nvidia with NVreg_RestrictProfilingToAdminUsers=0"
        )
    if err.value in NO_GPM:
        return UNSUPPORTED_REASON
    return f"GPM failed: {err}; asked again later"


def _metrics(first: Any, second: Any, ids: tuple[int, ...], what: str) -> dict[int, float]:
    """The GPM metrics `ids` between two samples, by metric id; none when the call fails."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(ids)
    request.sample1, request.sample2 = first, second
    for n, metric in enumerate(ids):
        request.metrics[n].metricId = metric
    try:
        pynvml.nvmlGpmMetricsGet(request)
    except pynvml.NVMLError as err:
        log.warning("%s: GPM metrics failed: %s", what, err)
        return {}
    return {
        metric.metricId: metric.value
        for metric in request.metrics[: len(ids)]
        if metric.nvmlReturn == pynvml.NVML_SUCCESS
    }


def instance_fields(values: dict[int, float]) -> dict[str, float | None]:
    """MigInstance fields from a GPU instance's GPM values (percent); a missing one is None."""
    return {name: ranges.ratio_from_percent(values.get(metric)) for name, metric in RATIOS.items()}


def fields(values: dict[int, float]) -> dict[str, Any]:
    """GpuReading fields from GPM values by metric id (percent, MiB/s); a missing one is None."""
    found: dict[str, Any] = dict(instance_fields(values))
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
    on = [str(index) for index, gpm in devices if gpm.pair is not None]
    off: dict[str, list[str]] = {}
    for index, gpm in devices:
        if gpm.reason:
            off.setdefault(gpm.reason, []).append(str(index))
    parts = [f"GPM profiling on GPU {', '.join(on)}"] if on else []
    parts += [f"no profiling metrics on GPU {', '.join(ids)}: {why}" for why, ids in off.items()]
    return "".join(f"; {part}" for part in parts)
