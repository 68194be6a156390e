"""The ascend source: recorded `npu-smi info` tables (910B, 310P3, 310B, A3) through a fake
npu-smi."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent import Agent
from fixtures import NPU_SMI
from fixtures.sysfs import FakeSysfs
from kepler_bridge.sources.ascend import AscendSource, parse
from kepler_bridge.sources.base import SourceAbsent, SourceUnavailable
from scaffold import make_config

MIB = 1024 * 1024


def fake_npu_smi(directory: Path, table: str, status: int = 0) -> Path:
    """An npu-smi that prints a recorded table for `info`
    (and a message on stderr when status != 0)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "table.txt").write_text(table)
    script = directory / "npu-smi"
    failure = f"{{ echo 'dcmi module initialize failed. ret is -8005' >&2; exit {status}; }}"
    script.write_text(
        f'#!/bin/sh\n[ "$1" = info ] || exit 64\n[ {status} -eq 0 ] || {failure}\n'
        f"cat '{directory / 'table.txt'}'\n"
    )
    script.chmod(0o755)
    return script


def table(name: str) -> str:
    return (NPU_SMI / f"{name}.txt").read_text()


def test_910b_hbm_is_the_device_memory() -> None:
    version, chips = parse(table("910b"))
    assert version == "24.1.0"
    assert [(chip.npu, chip.chip, chip.name, chip.health, chip.bus_id) for chip in chips] == [
        (0, 0, "910B3", "OK", "0000:C1:00.0"),
        (1, 0, "910B3", "Warning", "0000:C2:00.0"),
    ]
    assert (chips[0].memory_used_mib, chips[0].memory_total_mib) == (21064, 65536)
    assert (chips[0].power_watts, chips[0].temperature_celsius, chips[0].aicore_percent) == (
        96.4,
        41,
        35,
    )


def test_an_a3_names_its_chips_with_the_family_before_them() -> None:
    """npu-smi 25.5 on an Atlas A3 (a published table) prints "Ascend910" and a Phy-Id column:
    the device plugin's id is still Ascend910-<id>, the model not "Ascend Ascend910"."""
    source = AscendSource(make_config())
    source.driver_version = ""
    readings = [source._reading(index, chip) for index, chip in enumerate(parse(table("a3"))[1])]
    assert [(gpu.model, gpu.device_ids) for gpu in readings] == [
        ("Ascend 910", ("Ascend910-0",)),
        ("Ascend 910", ("Ascend910-1",)),
    ]


def test_310p3_memory_usage_and_na_power() -> None:
    version, chips = parse(table("310p3"))
    assert version == "23.0.rc3" and [chip.npu for chip in chips] == [0, 32]
    assert (chips[0].memory_used_mib, chips[0].memory_total_mib) == (19435, 21527)  # "19435/ 21527"
    assert chips[0].power_watts is None and chips[0].temperature_celsius == 49


def test_310b_edge_module_without_a_bus_id() -> None:
    _, (chip,) = parse(table("310b"))
    assert chip.bus_id == "" and chip.health == "Alarm" and chip.memory_total_mib == 15610


@pytest.mark.e2e
def test_in_the_agent(tmp_path: Path) -> None:
    npu_smi = fake_npu_smi(tmp_path / "bin", table("910b"))
    with Agent("--sources", "ascend", "--npu-smi", str(npu_smi), "--interval", "0.25s") as agent:
        text = agent.metrics()
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}  # Warning is not down
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.35, "1": 0.0}
        assert agent.samples("gpu_memory_used_bytes") == {"0": 21064 * MIB, "1": 3402 * MIB}
        assert agent.samples("gpu_memory_total_bytes") == {"0": 65536 * MIB, "1": 65536 * MIB}
        assert agent.samples("gpu_temperature_celsius") == {"0": 41.0, "1": 43.0}
        assert agent.samples("gpu_power_watts") == {"0": 96.4, "1": 101.2}
        assert (
            'gpu_info{driver_version="24.1.0",gpu="0",model="Ascend 910B3",node="test-node",'
            'pci_bus_id="0000:C1:00.0",uuid="ASCEND-0000:C1:00.0-0",vendor="huawei"} 1.0'
        ) in text
        assert agent.get("/v1/collect").json()["test-node"]["devices"][0] == {
            "usedMemory": 21064 * MIB,
            "totalMemory": 65536 * MIB,
            "percent": 21064 / 65536,
        }


def test_a_critical_chip_is_down_alone(tmp_path: Path) -> None:
    critical = table("910b").replace("| Warning       |", "| Critical      |")
    source = AscendSource(make_config(npu_smi=fake_npu_smi(tmp_path, critical)))
    source.start()
    ok, failing = source.read().gpus
    assert (
        ok.up and not failing.up and "health Critical" in failing.error and "-i 1" in failing.error
    )


@pytest.mark.e2e
def test_npu_smi_failing_is_a_clear_source_error_and_the_agent_keeps_serving(
    tmp_path: Path,
) -> None:
    npu_smi = fake_npu_smi(tmp_path / "bin", table("310p3"), status=255)
    with Agent(
        "--sources", "ascend", "--npu-smi", str(npu_smi), "--interval", "0.25s", ready=False
    ) as agent:
        expected = "npu-smi exited with status 255: dcmi module initialize failed. ret is -8005"
        agent.wait_for(
            lambda: expected in agent.get("/readyz").json()["reason"], what="the reason in /readyz"
        )
        assert agent.samples("kepler_bridge_source_up") == {"": 0.0}
        assert agent.get("/v1/collect").status_code == 200
        fake_npu_smi(tmp_path / "bin", table("310p3"))
        agent.wait_for(
            lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}, timeout=15, what="recovery"
        )


def test_npu_smi_is_found_in_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_npu_smi(tmp_path / "bin", table("310b"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    source = AscendSource(make_config())
    source.start()
    assert source.read().gpus[0].model == "Ascend 310B4"
    assert "driver 23.0.0" in source.describe(source.read())


def test_absent_without_npu_smi_or_npus(tmp_path: Path) -> None:
    config = make_config(npu_smi=tmp_path / "npu-smi", sysfs=tmp_path / "sys")
    with pytest.raises(SourceAbsent, match="npu-smi not found: install the Ascend driver"):
        AscendSource(config).start()


def test_npus_on_the_bus_without_npu_smi_is_a_mistake_to_report(tmp_path: Path) -> None:
    FakeSysfs(tmp_path / "sys").ascend_pci("0000:c1:00.0")
    config = make_config(npu_smi=tmp_path / "npu-smi", sysfs=tmp_path / "sys")
    with pytest.raises(
        SourceUnavailable, match="Huawei NPUs are on the PCI bus but .*--npu-smi PATH"
    ):
        AscendSource(config).start()
