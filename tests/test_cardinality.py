"""Per-process energy series stay bounded (top:N plus pid="other") with thousands of processes."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kepler_bridge import config
from kepler_bridge.exposition import prometheus
from kepler_bridge.model import CpuTimes, ProcessCpu, RaplZone, SourceReading
from kepler_bridge.sampler import Sampler, SnapshotStore
from kepler_bridge.sources import REGISTRY
from kepler_bridge.sources.base import Source

PROCESSES = 2000
CONTAINERS = 40


class ManyProcesses(Source):
    """2000 processes in 40 containers whose CPU use changes every sample, on a node drawing 200 W."""

    name = "many"

    def start(self) -> None:
        self.random = random.Random(7)
        self.samples = 0
        self.cpu = [0.0] * PROCESSES

    def read(self) -> SourceReading:
        self.samples += 1
        for i in range(PROCESSES):
            self.cpu[i] += self.random.random() * 0.01
        return SourceReading(
            processes=tuple(ProcessCpu(10_000 + i, f"worker-{i % 9}", self.cpu[i], f"{i % CONTAINERS:064x}")
                            for i in range(PROCESSES)),
            rapl_zones=(RaplZone("intel-rapl:0", "package", self.samples * 200_000_000, 262143328850),),
            cpu_times=CpuTimes(self.samples * 10.0, self.samples * 16.0))


def scrapes(process_metrics: str, monkeypatch: pytest.MonkeyPatch, samples: int) -> list[dict[str, list]]:
    """The /metrics families of each of `samples` samples."""
    monkeypatch.setitem(REGISTRY, "many", f"{__name__}:ManyProcesses")
    cfg = config.load({"sources": "many", "process_metrics": process_metrics}, {})
    sampler = Sampler(cfg, SnapshotStore())
    found = []
    for _ in range(samples):
        text = prometheus.render(sampler.sample(), cfg.metric_allowed).decode()
        found.append({family.name: family.samples for family in text_string_to_metric_families(text)})
    return found


def families(process_metrics: str, monkeypatch: pytest.MonkeyPatch, samples: int = 2) -> dict[str, list]:
    return scrapes(process_metrics, monkeypatch, samples)[-1]


def test_top_50_by_default_and_the_rest_in_other(monkeypatch: pytest.MonkeyPatch) -> None:
    found = scrapes("top:50", monkeypatch, samples=6)
    for before, after in zip(found[1:], found[2:]):
        process = after["kepler_bridge_process_cpu_joules"]
        assert len(process) == 51
        assert sum(sample.labels["pid"] == "other" for sample in process) == 1
        assert len(after["kepler_bridge_container_cpu_joules"]) == CONTAINERS
        assert len(after["kepler_bridge_pod_cpu_joules"]) == 1  # no Kubernetes: one pod row, empty labels
        energy_series = sum(len(samples) for name, samples in after.items() if "joules" in name)
        assert energy_series == 1 + 51 + CONTAINERS + 1
        # The shown processes and "other" together gained the node's active energy: 200 J x 10/16 usage.
        previous = {sample.labels["pid"]: sample.value for sample in before["kepler_bridge_process_cpu_joules"]}
        gained = sum(sample.value - previous.get(sample.labels["pid"], 0.0) for sample in process)
        assert gained == pytest.approx(200 * 10 / 16)


def test_all_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(families("all", monkeypatch, samples=2)["kepler_bridge_process_cpu_joules"]) == PROCESSES
    found = families("off", monkeypatch, samples=2)
    assert "kepler_bridge_process_cpu_joules" not in found
    assert len(found["kepler_bridge_container_cpu_joules"]) == CONTAINERS
