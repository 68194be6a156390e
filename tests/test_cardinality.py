"""Every per-process family stays bounded (top:N plus pid="other") with thousands of processes."""

from __future__ import annotations

import random
import time

import pytest

import scaffold
from kepler_bridge.exposition import RenderSettings, prometheus
from kepler_bridge.model import (
    CpuTimes,
    GpuProcess,
    GpuReading,
    ProcessCpu,
    RaplZone,
    SourceReading,
)
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.sources import REGISTRY
from kepler_bridge.sources.base import Source
from kepler_bridge.store import SnapshotStore

PROCESSES = 3000
CONTAINERS = 40
GPU_PROCESSES = 300  # the first 300 processes also use the node's one GPU
GIB = 1024**3
PER_PROCESS = (
    "kepler_bridge_process_cpu_seconds",
    "kepler_bridge_process_cpu_joules",
    "kepler_bridge_process_gpu_joules",
    "gpu_process_memory_used_bytes",
    "gpu_process_utilization_ratio",
)


def memory(i: int) -> int:
    """GPU memory of process i: a different amount for each GPU process."""
    return ((i * 37 + 17) % GPU_PROCESSES + 1) * 2**20


class ManyProcesses(Source):
    """3000 processes in 40 containers whose CPU use changes every sample, on a node drawing 200 W;
    300 of them share a GPU drawing 300 W, 100 W of it idle (`sampler`)."""

    name = "many"

    def start(self) -> None:
        self.random = random.Random(7)
        self.samples, self.started = 0, time.monotonic()
        self.cpu = [0.0] * PROCESSES

    def read(self) -> SourceReading:
        self.samples += 1
        for i in range(PROCESSES):
            self.cpu[i] += self.random.random() * 0.01
        gpu_processes = tuple(
            GpuProcess(
                10_000 + i,
                f"worker-{i % 9}",
                memory(i),
                self.random.random() / GPU_PROCESSES,
                container_id=f"{i % CONTAINERS:064x}",
            )
            for i in range(GPU_PROCESSES)
        )
        return SourceReading(
            gpus=(
                GpuReading(
                    0,
                    "GPU-many",
                    "nvidia",
                    "A100",
                    # 300 W of real time: a counter faster than a board is taken for garbage
                    energy_joules=300.0 * (time.monotonic() - self.started),
                    processes=gpu_processes,
                ),
            ),
            processes=tuple(
                ProcessCpu(10_000 + i, f"worker-{i % 9}", self.cpu[i], f"{i % CONTAINERS:064x}")
                for i in range(PROCESSES)
            ),
            rapl_zones=(
                RaplZone("intel-rapl:0", "package", self.samples * 200_000_000, 262143328850),
            ),
            cpu_times=CpuTimes(self.samples * 10.0, self.samples * 16.0),
        )


def sampler(process_metrics: str, monkeypatch: pytest.MonkeyPatch) -> Sampler:
    monkeypatch.setitem(REGISTRY, "many", f"{__name__}:ManyProcesses")
    # The GPU's processes share the 200 W above its idle power: each has GPU energy.
    settings = scaffold.make_config(
        sources="many", process_metrics=process_metrics, gpu_idle_watts=100
    )
    return Sampler(settings, SnapshotStore())


def scrape(many: Sampler) -> dict[str, list]:
    """The /metrics families of the next sample."""
    text = prometheus.render(many.sample(), RenderSettings.of(many.config).metric_allowed).decode()
    return {name: family.samples for name, family in scaffold.families(text).items()}


def scrapes(
    process_metrics: str, monkeypatch: pytest.MonkeyPatch, samples: int
) -> list[dict[str, list]]:
    """The /metrics families of each of `samples` samples."""
    many = sampler(process_metrics, monkeypatch)
    return [scrape(many) for _ in range(samples)]


def families(
    process_metrics: str, monkeypatch: pytest.MonkeyPatch, samples: int = 2
) -> dict[str, list]:
    return scrapes(process_metrics, monkeypatch, samples)[-1]


def test_top_50_by_default_and_the_rest_in_other(monkeypatch: pytest.MonkeyPatch) -> None:
    found = scrapes("top:50", monkeypatch, samples=6)
    for before, after in zip(found[1:], found[2:]):
        process = after["kepler_bridge_process_cpu_joules"]
        assert len(process) == 51
        assert sum(sample.labels["pid"] == "other" for sample in process) == 1
        assert len(after["kepler_bridge_container_cpu_joules"]) == CONTAINERS
        # No Kubernetes: one pod row, empty labels.
        assert len(after["kepler_bridge_pod_cpu_joules"]) == 1
        energy_series = sum(len(samples) for name, samples in after.items() if "joules" in name)
        # Node, processes, containers and pods of the CPU; the GPU's own counter, its idle part and
        # the same levels.
        assert energy_series == (1 + 51 + CONTAINERS + 1) + (1 + 1 + 51 + CONTAINERS + 1)
        # The shown processes and "other" together gained the node's active energy:
        # 200 J x 10/16 usage.
        previous = {
            sample.labels["pid"]: sample.value
            for sample in before["kepler_bridge_process_cpu_joules"]
        }
        gained = sum(sample.value - previous.get(sample.labels["pid"], 0.0) for sample in process)
        assert gained == pytest.approx(200 * 10 / 16)


def test_every_per_process_family_is_bounded_and_the_aggregates_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    many = sampler("top:50", monkeypatch)
    first = scrape(many)
    source = many.slots[0].source
    # First sample: the 50 processes with the most CPU time, each with all of it, and the rest
    # summed in "other".
    seconds = {
        sample.labels["pid"]: sample.value for sample in first["kepler_bridge_process_cpu_seconds"]
    }
    ranked = sorted(range(PROCESSES), key=lambda i: -source.cpu[i])
    assert seconds == {
        **{str(10_000 + i): pytest.approx(source.cpu[i]) for i in ranked[:50]},
        "other": pytest.approx(sum(source.cpu[i] for i in ranked[50:])),
    }
    for _ in range(3):
        before, cpu_before = seconds, sum(source.cpu)
        found = scrape(many)
        assert {name: len(found[name]) for name in PER_PROCESS} == dict.fromkeys(PER_PROCESS, 51)
        assert all(
            [sample.labels["pid"] for sample in found[name]].count("other") == 1
            for name in PER_PROCESS
        )
        for name in (
            "kepler_bridge_container_cpu_seconds",
            "kepler_bridge_container_cpu_joules",
            "kepler_bridge_container_gpu_joules",
        ):
            assert len(found[name]) == CONTAINERS, name
        # The shown series and "other" together gained every process's CPU time, and none decreased.
        seconds = {
            sample.labels["pid"]: sample.value
            for sample in found["kepler_bridge_process_cpu_seconds"]
        }
        assert all(value >= before.get(pid, 0.0) for pid, value in seconds.items())
        gained = sum(value - before.get(pid, 0.0) for pid, value in seconds.items())
        assert gained == pytest.approx(sum(source.cpu) - cpu_before)
    # The gauges show their 50 highest values; "other" holds the sum of the rest on that GPU.
    amounts = sorted((memory(i) for i in range(GPU_PROCESSES)), reverse=True)
    shown = {
        sample.labels["pid"]: sample.value for sample in found["gpu_process_memory_used_bytes"]
    }
    assert sorted(value for pid, value in shown.items() if pid != "other") == sorted(amounts[:50])
    assert shown["other"] == sum(amounts[50:])


def test_all_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    found = families("all", monkeypatch, samples=2)
    assert {name: len(found[name]) for name in PER_PROCESS} == {
        "kepler_bridge_process_cpu_seconds": PROCESSES,
        "kepler_bridge_process_cpu_joules": PROCESSES,
        # Only the processes on the GPU have GPU energy.
        "kepler_bridge_process_gpu_joules": GPU_PROCESSES,
        "gpu_process_memory_used_bytes": GPU_PROCESSES,
        "gpu_process_utilization_ratio": GPU_PROCESSES,
    }
    found = families("off", monkeypatch, samples=2)
    assert not set(PER_PROCESS) & set(found)
    assert len(found["kepler_bridge_container_cpu_joules"]) == CONTAINERS
    assert len(found["kepler_bridge_container_cpu_seconds"]) == CONTAINERS
