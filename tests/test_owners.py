"""Kubernetes owners are joined once, in the sampler: every series a sample updates names that
sample's owner."""

from __future__ import annotations

import time
from typing import Iterable

from kepler_bridge.exposition import prometheus
from kepler_bridge.kube.view import Assignment, KubeView, device_owners
from kepler_bridge.model import (
    CpuTimes,
    GpuProcess,
    GpuReading,
    PodRef,
    ProcessCpu,
    RaplZone,
    SourceReading,
)
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.sampling.slots import Slot
from kepler_bridge.sources.base import Source
from kepler_bridge.store import SnapshotStore
from scaffold import make_config, samples

GIB = 1024**3
# Families with one series per process, container or device: each names the owner of the
# newest sample.
CURRENT = (
    "gpu_pod_info",
    "gpu_process_memory_used_bytes",
    "gpu_process_utilization_ratio",
    "kepler_bridge_container_cpu_seconds_total",
    "kepler_bridge_process_cpu_joules_total",
    "kepler_bridge_process_gpu_joules_total",
)
# Families whose series of an owner that has gone stay until the grace period ends, but no
# longer grow.
GROWING = (
    "kepler_bridge_container_cpu_joules_total",
    "kepler_bridge_container_gpu_joules_total",
    "kepler_bridge_pod_cpu_joules_total",
    "kepler_bridge_pod_gpu_joules_total",
)


class Node(Source):
    """Container c1 training on a GPU that lists its processes (and loading on the CPU only), next
    to a process of another pid namespace, and a card that lists none; the kubelet assigned both
    devices to c0 of the same pod."""

    name = "node"

    def start(self) -> None:
        self.samples, self.started = 0, time.monotonic()

    def read(self) -> SourceReading:
        self.samples += 1
        n = self.samples
        processes = (
            GpuProcess(1, "train", GIB, 0.6, container_id="c1"),
            GpuProcess(2, "", GIB, 0.4),
        )
        return SourceReading(
            gpus=(
                GpuReading(
                    0,
                    "GPU-0",
                    "nvidia",
                    "A100",
                    # 300 W: a counter that grows faster than a board can is taken for garbage
                    energy_joules=300.0 * (time.monotonic() - self.started),
                    processes=processes,
                ),
                GpuReading(1, "AMD-1", "amd", "MI210", power_watts=200.0, lists_processes=False),
            ),
            processes=(
                ProcessCpu(1, "train", 0.5 * n, "c1"),
                ProcessCpu(3, "loader", 0.25 * n, "c1"),
            ),
            rapl_zones=(RaplZone("intel-rapl:0", "package", 100_000_000 * n, 262143328850),),
            cpu_times=CpuTimes(1.0 * n, 4.0 * n),
        )


class Kube:
    """The sampler's Kubernetes metadata, whose view the test replaces between samples."""

    def __init__(self) -> None:
        self.current = KubeView()

    def view(self) -> KubeView:
        return self.current

    def notice(self, container_ids: Iterable[str]) -> None:
        pass

    def stop(self, timeout: float) -> None:
        pass


def owned_by(pod: str) -> KubeView:
    holder = PodRef("ml", pod, "main")
    return KubeView(
        containers={"c0": holder, "c1": PodRef("ml", pod, "trainer")},
        devices=device_owners([Assignment(uuid, "gpu", holder) for uuid in ("GPU-0", "AMD-1")]),
    )


def agrees(labels: dict[str, str], pod: str) -> bool:
    """Whether a series names its owner in the view of pod `pod`: c1's rows c1's container,
    the rest (the devices, the process of another pid namespace, the card's energy) the container
    holding the devices."""
    mine = labels.get("container_id") == "c1" or labels.get("pid") == "1"
    owner = {"namespace": "ml", "pod": pod, "container": "trainer" if mine else "main"}
    return all(labels[name] == value for name, value in owner.items() if name in labels)


def test_every_series_a_sample_updates_names_the_owner_of_that_sample() -> None:
    settings = make_config(
        sources="simulated",
        kube_source="off",
        pod_resources_socket="",
        process_metrics="all",
        gpu_idle_watts="50",
    )
    source = Node(settings)
    source.start()
    sampler = Sampler(settings, SnapshotStore(), [Slot("node", source, started=True)])
    sampler.kube = Kube()
    before: dict[tuple, float] = {}
    for pod in ("train-0", "train-0", "train-1", "train-1", "train-2", "train-0"):
        sampler.kube.current = owned_by(pod)
        text = prometheus.render(sampler.sample(), lambda name: True).decode()
        after = {
            (sample.name, tuple(sorted(sample.labels.items()))): (sample.labels, sample.value)
            for sample in samples(text)
        }
        for name in CURRENT:
            series = [labels for (found, _), (labels, _) in after.items() if found == name]
            assert series or not before, name  # energy series from the second sample on
            assert all(agrees(labels, pod) for labels in series), (name, pod, series)
        grown = [
            labels
            for key, (labels, value) in after.items()
            if key[0] in GROWING and value > before.get(key, 0.0)
        ]
        assert grown or not before
        assert all(agrees(labels, pod) for labels in grown), (pod, grown)
        before = {key: value for key, (_, value) in after.items()}
