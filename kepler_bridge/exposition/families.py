"""The metric families of the catalogue, made by name, and the pod labels of a row."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from kepler_bridge.exposition.catalogue import METRICS, POD_LABELS
from kepler_bridge.model import Holder, PodRef


def gauge(name: str, labels: Iterable[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name], labels=list(labels))


def counter(name: str, labels: Iterable[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), METRICS[name], labels=list(labels))


def info(name: str, labels: Iterable[str]) -> InfoMetricFamily:
    return InfoMetricFamily(name.removesuffix("_info"), METRICS[name], labels=list(labels))


def pod_labels(owner: PodRef, names: tuple[str, ...] = POD_LABELS) -> list[str]:
    """The pod labels of a row, read from its owner."""
    return [getattr(owner, name) for name in names]


def holder_labels(holder: Holder) -> dict[str, str]:
    """The labels of a device's holder (gpu_pod_info): its pod labels, and how it was learned."""
    return {**dict(zip(POD_LABELS, pod_labels(holder.owner))), "source": holder.source}
