"""The amdgpu source on fake sysfs trees (kernel docs gpu/amdgpu: file names and units),
in the real agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import Agent
from fixtures.sysfs import GIB, FakeSysfs, record_reads
from kepler_bridge.sources.amdgpu import AmdgpuSource
from kepler_bridge.sources.base import SourceAbsent
from scaffold import make_config


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    """A firmware framebuffer (card0), an RX 7900 (card1), an MI210 (card2) and an Intel iGPU
    (card3)."""
    tree = FakeSysfs(tmp_path / "sys")
    tree.simpledrm(0)
    tree.amd_rx7900(1, "0000:03:00.0")
    tree.amd_mi210(2, "0000:43:00.0")
    tree.intel_igpu(3, "0000:00:02.0")
    return tree


def amd_agent(sysfs: FakeSysfs, ready: bool = True) -> Agent:
    return Agent(
        "--sources", "amdgpu", "--sysfs", str(sysfs.root), "--interval", "0.25s", ready=ready
    )


@pytest.mark.e2e
def test_values_arrive_in_contract_units(sysfs: FakeSysfs) -> None:
    with amd_agent(sysfs) as agent:
        text = agent.metrics()
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.37, "1": 1.0}
        assert agent.samples("gpu_memory_utilization_ratio") == {"0": 0.12, "1": 0.6}
        assert agent.samples("gpu_memory_total_bytes") == {"0": 24 * GIB, "1": 64 * GIB}
        assert agent.samples("gpu_memory_used_bytes") == {"0": 3 * GIB, "1": 48 * GIB}
        assert agent.samples("gpu_memory_free_bytes") == {"0": 21 * GIB, "1": 16 * GIB}
        # edge where the card has it; the MI210 has none,
        # so its junction sensor is the core temperature.
        assert agent.samples("gpu_temperature_celsius") == {"0": 45.0, "1": 71.0}
        assert agent.samples("gpu_memory_temperature_celsius") == {"0": 58.0, "1": 66.0}
        # power1_input (µW) where power1_average is absent, power1_average where present.
        assert agent.samples("gpu_power_watts") == {"0": 65.0, "1": 289.0}
        assert agent.samples("gpu_power_limit_watts") == {"0": 327.0, "1": 300.0}
        assert agent.samples("gpu_sm_clock_hertz") == {"0": 2.5e9, "1": 1.7e9}
        assert agent.samples("gpu_memory_clock_hertz") == {"0": 1.249e9, "1": 1.6e9}
        assert agent.samples("gpu_fan_speed_ratio") == {"0": 0.4}
        assert agent.samples("gpu_energy_joules_total") == {"1": pytest.approx(123456.789)}
        assert (
            'uuid="AMD-b2c8a7e2f3d41c8f",vendor="amd"} 7.0' in text
        )  # corrected ECC from ras/umc_err_count
        assert (
            'gpu_info{driver_version="",gpu="0",model="AMD GPU 0x744c",node="test-node",'
            'pci_bus_id="0000:03:00.0",uuid="AMD-0000:03:00.0",vendor="amd"} 1.0' in text
        )
        assert 'model="AMD Instinct MI210"' in text
        body = agent.get("/v1/collect").json()["test-node"]
        assert body["deviceNum"] == 2
        assert body["devices"] == [
            {"usedMemory": 3 * GIB, "totalMemory": 24 * GIB, "percent": 0.125},
            {"usedMemory": 48 * GIB, "totalMemory": 64 * GIB, "percent": 0.75},
        ]
        assert body["usedMemory"] == 51 * GIB and body["totalMemory"] == 88 * GIB


def test_an_apus_soc_power_is_not_the_gpus(tmp_path: Path) -> None:
    """On an APU power1_average is the whole SoC's, CPU cores included ("On APUs this includes the
    CPU", the kernel's amdgpu docs), which RAPL's package counts: taken as the GPU's, the socket's
    energy would count twice."""
    tree = FakeSysfs(tmp_path / "sys")
    tree.amd_phoenix_apu(0, "0000:c4:00.0")
    source = AmdgpuSource(make_config(sysfs=str(tree.root)))
    source.start()
    (gpu,) = source.read().gpus
    assert (gpu.power_watts, gpu.power_limit_watts, gpu.energy_joules) == (None, None, None)
    assert gpu.utilization == 0.2 and gpu.temperature_celsius == 52.0


@pytest.mark.e2e
def test_out_of_range_readings_are_dropped(sysfs: FakeSysfs) -> None:
    device = sysfs.root / "devices" / "pci0000:00" / "0000:03:00.0"
    hwmon = next((device / "hwmon").iterdir())
    sysfs.write(device, {"gpu_busy_percent": 250, "mem_busy_percent": -1})
    sysfs.write(
        hwmon,
        {
            "temp1_input": 4294967295,
            "temp3_input": -273000,
            "power1_input": 9_999_000_000,
            "freq1_input": 0,
            "pwm1": 300,
            "freq2_input": "garbage",
        },
    )
    with amd_agent(sysfs) as agent:
        for name in (
            "gpu_utilization_ratio",
            "gpu_memory_utilization_ratio",
            "gpu_temperature_celsius",
            "gpu_memory_temperature_celsius",
            "gpu_power_watts",
            "gpu_sm_clock_hertz",
            "gpu_memory_clock_hertz",
        ):
            assert set(agent.samples(name)) == {"1"}, name
        assert agent.samples("gpu_fan_speed_ratio") == {}
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}


def test_numbers_no_driver_prints_are_no_value_and_the_other_card_reads_on(
    sysfs: FakeSysfs,
) -> None:
    """Thousands of digits (float() of them overflows) and digits of other scripts (str.isdigit
    takes '²', int() does not) read as "cannot report": before, the read of every card failed."""
    device = sysfs.root / "devices" / "pci0000:00" / "0000:03:00.0"
    hwmon = next((device / "hwmon").iterdir())
    sysfs.write(hwmon, {"power1_input": "9" * 400, "pwm1": "9" * 400, "temp1_input": "4_2000"})
    sysfs.write(device, {"ras/umc_err_count": "ue: 1\nce: \u00b2"})
    source = AmdgpuSource(make_config(sysfs=str(sysfs.root)))
    source.start()
    first, second = source.read().gpus
    assert (first.up, second.up) == (True, True)
    assert (first.power_watts, first.fan_speed_ratio, first.temperature_celsius) == (None,) * 3
    assert (first.ecc_corrected_total, first.ecc_uncorrected_total) == (None, 1)
    assert second.power_watts is not None


@pytest.mark.e2e
def test_a_card_that_goes_away_is_down_alone_and_comes_back(sysfs: FakeSysfs) -> None:
    card = sysfs.root / "class" / "drm" / "card2"
    target = card.readlink()
    with amd_agent(sysfs) as agent:
        card.unlink()
        agent.wait_for(lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 0.0}, what="card2 down")
        assert set(agent.samples("gpu_memory_used_bytes")) == {"0"}
        assert agent.samples("kepler_bridge_source_up") == {"": 1.0}
        devices = agent.get("/v1/collect").json()["test-node"]["devices"]
        assert devices[1] == {"usedMemory": 0, "totalMemory": 0, "percent": 0}
        card.symlink_to(target)
        agent.wait_for(lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}, what="card2 back")


@pytest.mark.e2e
def test_every_card_gone_marks_the_source_down_and_the_agent_keeps_serving(
    sysfs: FakeSysfs,
) -> None:
    with amd_agent(sysfs) as agent:
        for card in ("card1", "card2"):
            (sysfs.root / "class" / "drm" / card).unlink()
        agent.wait_for(
            lambda: agent.samples("kepler_bridge_source_up") == {"": 0.0}, what="amdgpu down"
        )
        assert "every AMD GPU failed" in agent.get("/readyz").json()["reason"]
        assert agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 2


def test_a_runtime_suspended_card_is_read_without_waking_it(
    sysfs: FakeSysfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle dGPU the kernel suspended reads as idle, from files that do not wake it: not its
    busy percents, hwmon or RAS counters, which would resume it at every sample. Awake again, or
    where runtime PM is unsupported (an APU), it is read whole."""
    device = sysfs.root / "devices" / "pci0000:00" / "0000:03:00.0"
    source = AmdgpuSource(make_config(sysfs=str(sysfs.root)))
    source.start()
    opened = record_reads(monkeypatch)
    for status in ("suspended", "unsupported", "active"):
        sysfs.write(device / "power", {"runtime_status": status})
        opened.clear()
        asleep, awake = source.read().gpus
        touched = {Path(path).name for path in opened if path.startswith(str(device))}
        if status == "suspended":
            assert touched == {"runtime_status", "mem_info_vram_used", "mem_info_vram_total"}
            assert (asleep.utilization, asleep.memory_utilization) == (0.0, 0.0)
            assert (asleep.temperature_celsius, asleep.power_watts, asleep.energy_joules) == (
                (None,) * 3
            )
        else:
            assert {"gpu_busy_percent", "umc_err_count"} <= touched, status
            assert asleep.utilization == 0.37 and asleep.temperature_celsius == 45.0
        assert (asleep.memory_used_bytes, asleep.memory_total_bytes) == (3 * GIB, 24 * GIB)
        assert awake.utilization == 1.0


def test_absent_without_an_amdgpu_card(tmp_path: Path) -> None:
    FakeSysfs(tmp_path / "sys").intel_igpu(0, "0000:00:02.0")
    with pytest.raises(
        SourceAbsent, match="no DRM card bound to the amdgpu driver .*--sysfs /host/sys"
    ):
        AmdgpuSource(make_config(sysfs=tmp_path / "sys")).start()
