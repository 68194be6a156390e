"""The anomaly families of a snapshot: what the anomaly thread found per device (none before it
has looked at a device, no score or fit time before the device has a model)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import Metric

from kepler_bridge.exposition.catalogue import GPU_LABELS
from kepler_bridge.exposition.families import counter, gauge
from kepler_bridge.model import GpuReading, Snapshot


def anomaly_families(
    snapshot: Snapshot, labels: Callable[[GpuReading], list[str]]
) -> Iterator[Metric]:
    """gpu_anomaly per kind, gpu_anomaly_score, the fit time and the detection's CPU time;
    nothing while detection is off. `labels`: a device's labels."""
    found = snapshot.anomalies
    if found is None:
        return
    firing = gauge("gpu_anomaly", GPU_LABELS + ("kind",))
    score = gauge("gpu_anomaly_score", GPU_LABELS)
    fitted = gauge("kepler_bridge_anomaly_model_fitted_timestamp_seconds", GPU_LABELS)
    devices = {device.uuid: device for device in found.devices}
    for gpu in snapshot.gpus:
        device = devices.get(gpu.uuid)
        if device is None or not gpu.up:
            continue
        names = labels(gpu)
        for kind in found.kinds:
            if kind != "unusual" or device.fitted_timestamp is not None:  # the model's kind
                firing.add_metric(names + [kind], 1.0 if kind in device.firing else 0.0)
        if device.score is not None:
            score.add_metric(names, device.score)
        if device.fitted_timestamp is not None:
            fitted.add_metric(names, device.fitted_timestamp)
    cpu = counter("kepler_bridge_anomaly_cpu_seconds_total", ("node",))
    cpu.add_metric([snapshot.node], found.cpu_seconds)
    yield from (firing, score, fitted, cpu)
