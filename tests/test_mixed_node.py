"""A heterogeneous node: a (fake) NVIDIA GPU, an AMD card and a command-source accelerator in
one agent."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agent import KEPLER_BRIDGE, Agent
from fakenvml import FakeNvml
from fixtures.sysfs import GIB, FakeSysfs
from kepler_bridge import sources
from kepler_bridge.sampling.slots import build_slots
from scaffold import make_config, samples, values

KUNLUN = {
    "devices": [
        {
            "uuid": "KL-R200-01",
            "vendor": "kunlun",
            "model": "Kunlun R200",
            "usedMemory": 2 * GIB,
            "totalMemory": 16 * GIB,
            "utilization": 0.35,
            "temperature": 55,
            "power": 75.5,
        }
    ]
}


@pytest.fixture
def node(fakenvml_lib: Path, tmp_path: Path) -> tuple[FakeNvml, list[str]]:
    """One fake NVIDIA GPU, an RX 7900 in a fake sysfs and a command printing one Kunlun card:
    agent args."""
    nvidia = FakeNvml(fakenvml_lib, tmp_path / "fakenvml.conf", gpus=1, processes_per_gpu=1)
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.simpledrm(0)
    sysfs.amd_rx7900(1, "0000:03:00.0")
    command = shlex.join([sys.executable, "-c", f"print({json.dumps(json.dumps(KUNLUN))})"])
    return nvidia, [
        "--sources",
        "nvml,amdgpu",
        "--nvml-library",
        str(nvidia.library),
        "--sysfs",
        str(sysfs.root),
        "--command",
        command,
    ]


def labels_by_gpu(text: str) -> dict[str, tuple[str, str, str]]:
    return {
        sample.labels["gpu"]: (
            sample.labels["vendor"],
            sample.labels["model"],
            sample.labels["uuid"],
        )
        for sample in samples(text, "gpu_up")
    }


@pytest.mark.e2e
def test_one_index_one_collect_entry_for_every_vendor(node: tuple[FakeNvml, list[str]]) -> None:
    nvidia, args = node
    with Agent(*args, "--interval", "0.25s", env=nvidia.env()) as agent:
        assert labels_by_gpu(agent.metrics()) == {
            "0": ("nvidia", "NVIDIA Fake A100", "GPU-fa4e0000-0000-4000-8000-000000000000"),
            "1": ("amd", "AMD GPU 0x744c", "AMD-0000:03:00.0"),
            "2": ("kunlun", "Kunlun R200", "KL-R200-01"),
        }
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0, "2": 1.0}
        assert agent.samples("gpu_memory_total_bytes") == {
            "0": 80 * GIB,
            "1": 24 * GIB,
            "2": 16 * GIB,
        }
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.5, "1": 0.37, "2": 0.35}
        assert agent.samples("gpu_power_watts") == {"0": 250.0, "1": 65.0, "2": 75.5}
        up = values(agent.metrics(), "kepler_bridge_source_up", "source")
        assert up == {"nvml": 1.0, "amdgpu": 1.0, "command": 1.0}
        body = agent.get("/v1/collect").json()
        assert list(body) == ["test-node"]
        node = body["test-node"]
        assert node["deviceNum"] == 3
        assert node["devices"] == [
            {"usedMemory": 10 * GIB, "totalMemory": 80 * GIB, "percent": 0.125},
            {"usedMemory": 3 * GIB, "totalMemory": 24 * GIB, "percent": 0.125},
            {"usedMemory": 2 * GIB, "totalMemory": 16 * GIB, "percent": 0.125},
        ]
        assert (node["usedMemory"], node["totalMemory"], node["percent"]) == (
            15 * GIB,
            120 * GIB,
            0.125,
        )


@pytest.mark.e2e
def test_one_vendor_failing_leaves_the_others_serving(node: tuple[FakeNvml, list[str]]) -> None:
    nvidia, args = node
    with Agent(*args, "--interval", "0.25s", env=nvidia.env()) as agent:
        nvidia.set(fail_all=999)
        agent.wait_for(
            lambda: agent.samples("gpu_up") == {"0": 0.0, "1": 1.0, "2": 1.0}, what="NVIDIA down"
        )
        devices = agent.get("/v1/collect").json()["test-node"]["devices"]
        assert devices[0] == {"usedMemory": 0, "totalMemory": 0, "percent": 0}
        assert devices[1]["totalMemory"] == 24 * GIB and devices[2]["totalMemory"] == 16 * GIB


@pytest.mark.e2e
def test_doctor_reports_each_vendor_it_found(node: tuple[FakeNvml, list[str]]) -> None:
    nvidia, args = node
    result = subprocess.run(
        [KEPLER_BRIDGE, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **nvidia.env()},
    )
    lines = {
        line.split()[1]: line
        for line in result.stdout.splitlines()
        if line.startswith(("ok ", "no "))
    }
    assert lines["nvml"].startswith("ok ") and "NVIDIA Fake A100" in lines["nvml"]
    assert lines["amdgpu"].startswith("ok ") and "amd AMD GPU 0x744c" in lines["amdgpu"]
    assert lines["command"].startswith("ok ") and "kunlun Kunlun R200" in lines["command"]
    assert (
        lines["intel"].startswith("no ")
        and "no DRM card bound to the i915 or xe driver" in lines["intel"]
    )
    assert lines["jetson"].startswith("no ") and "not a Jetson" in lines["jetson"]
    assert lines["ascend"].startswith("no ") and "npu-smi not found" in lines["ascend"]


def test_auto_marks_the_accelerators_this_node_does_not_have_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.amd_mi210(0, "0000:43:00.0")
    monkeypatch.setattr(sources, "AUTO", (("amdgpu",), ("intel",), ("jetson",), ("ascend",)))
    monkeypatch.setenv("PATH", str(tmp_path))  # no npu-smi
    config = make_config(sysfs=sysfs.root, procfs=tmp_path / "proc", npu_smi="npu-smi")
    slots = build_slots(config)
    assert [slot.name for slot in slots if slot.started] == ["amdgpu"]
    absent = {slot.name: slot.error for slot in slots if slot.not_in_use == "absent"}
    assert set(absent) == {"intel", "jetson", "ascend"} and "npu-smi not found" in absent["ascend"]
    assert not any(slot.errors_total for slot in slots), "absent hardware is no error"
