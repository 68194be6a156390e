"""The seed's own allow-list file through the real agent: it shapes /metrics only,
never /v1/collect or health."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml
from scaffold import samples

GIB = 1024**3
SEED_ALLOW_LIST = Path(__file__).parent / "fixtures" / "seed-metrics-allow-list.json"
HEALTH = {
    "gpu_up",
    "kepler_bridge_source_up",
    "kepler_bridge_source_state",
    "kepler_bridge_build_info",
    "kepler_bridge_last_sample_timestamp_seconds",
}


pytestmark = pytest.mark.e2e


def test_seed_allow_list_keeps_collect_whole_and_health_series(fake_nvml: FakeNvml) -> None:
    with Agent(
        "--config",
        str(SEED_ALLOW_LIST),
        "--sources",
        "nvml",
        "--nvml-library",
        str(fake_nvml.library),
        "--interval",
        "0.25s",
        env=fake_nvml.env(),
    ) as agent:
        names = {sample.name for sample in samples(agent.metrics())}
        collect = agent.get("/v1/collect").json()["test-node"]
        up = agent.samples("gpu_up")
    assert (
        names
        == {"gpu_utilization_ratio", "gpu_memory_used_bytes", "gpu_temperature_celsius"} | HEALTH
    )
    assert up == {"0": 1.0, "1": 1.0}
    device = {"usedMemory": 10 * GIB, "totalMemory": 80 * GIB, "percent": 0.125}
    assert collect == {
        "deviceNum": 2,
        "devices": [device, device],
        "usedMemory": 20 * GIB,
        "totalMemory": 160 * GIB,
        "percent": 0.125,
    }
