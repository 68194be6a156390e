"""Source states: only a source in use that fails is down; absent hardware and a standing-by
alternative are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml
from fixtures.sysfs import FakeSysfs
from kepler_bridge.exposition import prometheus
from kepler_bridge.model import SOURCE_STATES, Snapshot, SourceStatus
from scaffold import samples, values

NVML_DRIVER_NOT_LOADED = 9


def test_up_series_for_sources_in_use_and_a_state_for_every_source() -> None:
    sources = (
        SourceStatus("nvml", True),
        SourceStatus("amdgpu", False, "card lost", 3),
        SourceStatus("ebpf", False, "no BTF", 1, not_in_use="standby"),
        SourceStatus("ascend", False, "npu-smi not found", not_in_use="absent"),
    )
    text = prometheus.render(
        Snapshot(
            node="n1", timestamp=1.0, duration_seconds=0.01, interval_seconds=1.0, sources=sources
        ),
        lambda name: True,
    ).decode()
    up = values(text, "kepler_bridge_source_up", "source")
    errors = values(text, "kepler_bridge_source_errors_total", "source")
    state = {
        (s.labels["source"], s.labels["state"]): s.value
        for s in samples(text, "kepler_bridge_source_state")
    }
    assert up == {"nvml": 1.0, "amdgpu": 0.0}
    assert errors == {"nvml": 0.0, "amdgpu": 3.0}
    assert state == {
        (source.name, name): float(name == source.state)
        for source in sources
        for name in SOURCE_STATES
    }
    assert [source.state for source in sources] == ["up", "down", "standby", "absent"]


@pytest.mark.e2e
def test_nvml_without_an_nvidia_gpu_is_absent_says_why_and_starts_when_the_driver_does(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.amd_rx7900(
        0, "0000:03:00.0"
    )  # a GPU, but no NVIDIA one: NVML not starting is no failure here
    fake_nvml.set(init_error=NVML_DRIVER_NOT_LOADED)
    with Agent(
        "--sources",
        "nvml,amdgpu",
        "--nvml-library",
        str(fake_nvml.library),
        "--sysfs",
        str(sysfs.root),
        "--interval",
        "0.25s",
        env=fake_nvml.env(),
    ) as agent:
        assert agent.source_states() == {"nvml": "absent", "amdgpu": "up"}
        assert "nvml" not in values(agent.metrics(), "kepler_bridge_source_up", "source")
        ready = agent.get("/readyz").json()
        assert ready["ready"] and ready["sources"]["amdgpu"] == {"state": "up", "reason": ""}
        assert ready["sources"]["nvml"]["state"] == "absent"
        reason = ready["sources"]["nvml"]["reason"]
        assert (
            "no NVIDIA GPU on the PCI bus" in reason and "kernel driver is not loaded" in reason
        ), reason
        assert "source nvml is absent: no NVIDIA GPU" in agent.output()
        fake_nvml.set(
            init_error=0
        )  # absent hardware is looked for again: here an (unusual) NVML that starts
        agent.wait_for(
            lambda: agent.source_states()["nvml"] == "up", timeout=40, what="nvml retried"
        )
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0, "2": 1.0}


def test_an_error_text_new_every_sample_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kepler_bridge.model import SourceReading
    from kepler_bridge.sampling.slots import Slot
    from kepler_bridge.sources.base import Source

    class Failing(Source):
        name = "failing"
        reads = 0

        def __init__(self) -> None:
            pass

        def start(self) -> None:
            pass

        def read(self) -> SourceReading:
            Failing.reads += 1
            raise OSError(f"boom at {Failing.reads}")

    slot = Slot("failing", Failing())
    with caplog.at_level("WARNING", logger="kepler_bridge.sampling.slots"):
        for tick in range(100):
            slot.read(1.0, float(tick))
    assert Failing.reads >= 50
    lines = [r.getMessage() for r in caplog.records if "failing failed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert slot.errors_total == Failing.reads
