"""The jetson source on fake Tegra sysfs trees: devfreq, INA3221 (hwmon and iio), thermal zones,
meminfo."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent import Agent
from fixtures.sysfs import FakeSysfs
from kepler_bridge.sources import jetson as jetson_module
from kepler_bridge.sources.base import SourceAbsent
from kepler_bridge.sources.jetson import JetsonSource
from scaffold import make_config


def jetson(sysfs: FakeSysfs, procfs: Path) -> JetsonSource:
    """The source, started, on a clock that moves a second at each look: a sample a second."""
    source = JetsonSource(make_config(sysfs=sysfs.root, procfs=procfs, interval="1s"))
    source.clock = itertools.count(0.0, 1.0).__next__
    source.start()
    return source


def _ina3221(sysfs: FakeSysfs) -> Path:
    """The hwmon device of the tree's INA3221."""
    return next(
        path
        for path in (sysfs.root / "class" / "hwmon").iterdir()
        if (path / "name").read_text().strip() == "ina3221"
    )


@pytest.mark.e2e
def test_orin_in_the_agent(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    with Agent(
        "--sources",
        "jetson",
        "--sysfs",
        str(sysfs.root),
        "--procfs",
        str(tmp_path / "proc"),
        "--interval",
        "0.25s",
    ) as agent:
        text = agent.metrics()
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.523}  # load is per mille
        assert agent.samples("gpu_sm_clock_hertz") == {"0": 918e6}
        # The GPU allocates from system RAM: MemTotal, and MemTotal - MemAvailable in use.
        assert agent.samples("gpu_memory_total_bytes") == {"0": 31_000_000 * 1024}
        assert agent.samples("gpu_memory_used_bytes") == {"0": 6_000_000 * 1024}
        assert agent.samples("gpu_power_watts") == {"0": 6.0}  # VDD_GPU_SOC: 5000 mV x 1200 mA
        assert agent.samples("gpu_temperature_celsius") == {"0": 45.5}
        assert (
            'model="NVIDIA Jetson AGX Orin Developer Kit",node="test-node",'
            'uuid="JETSON-1421022123456",vendor="nvidia"'
        ) in text
        body = agent.get("/v1/collect").json()["test-node"]
        assert body["deviceNum"] == 1 and body["totalMemory"] == 31_000_000 * 1024


def test_nano_with_the_older_iio_power_driver(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_nano(tmp_path / "proc")
    source = jetson(sysfs, tmp_path / "proc")
    (gpu,) = source.read().gpus
    assert gpu.utilization == 1.0
    assert gpu.power_watts == pytest.approx(
        1.234
    )  # POM_5V_GPU in milliwatts, not the board's POM_5V_IN
    assert gpu.temperature_celsius == 38.5  # GPU-therm
    assert gpu.uuid == "JETSON-57000000.gpu"  # no serial number in this device tree
    assert "power rail POM_5V_GPU" in source.describe(source.read())


def test_a_rail_shared_with_the_cpu_is_used_when_the_gpu_has_none_alone(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    hwmon = _ina3221(sysfs)
    sysfs.write(
        hwmon, {"in1_label": "VDD_IN", "in2_label": "VDD_CPU_GPU_CV"}
    )  # Orin NX / Nano labels
    assert jetson(sysfs, tmp_path / "proc").read().gpus[0].power_watts == 4.0


def test_a_rail_whose_channel_another_takes_is_found_again(tmp_path: Path) -> None:
    """hwmon devices are numbered anew when the INA3221 driver loads again: the GPU's channel may
    then be another rail (the CPU's, read as the GPU's power before), or be gone for a while."""
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    hwmon = _ina3221(sysfs)
    source = jetson(sysfs, tmp_path / "proc")
    assert source.read().gpus[0].power_watts == 6.0  # VDD_GPU_SOC: 5 V x 1.2 A
    sysfs.write(hwmon, {"in1_label": "VDD_CPU_CV", "in2_label": "VDD_GPU_SOC"})
    assert source.read().gpus[0].power_watts == 4.0  # the GPU rail, now channel 2
    sysfs.write(hwmon, {"in1_label": "VIN_SYS_5V0", "in2_label": "VDD_CPU_CV"})
    gpu = source.read().gpus[0]
    assert gpu.up and gpu.power_watts is None
    sysfs.write(hwmon, {"in1_label": "VDD_GPU_SOC", "in2_label": "VDD_CPU_CV"})
    assert source.read().gpus[0].power_watts == 6.0


def test_sensors_whose_drivers_probe_after_start_are_found(tmp_path: Path) -> None:
    """At boot the Jetson's drivers probe in any order: jetson-stats #425 and #889 saw the nvgpu
    devfreq node appear after its service started. A GPU found before its INA3221 (hwmon) and
    thermal drivers probe must gain power and temperature when they do, not stay without."""
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin_jp6(tmp_path / "proc")
    source = jetson(sysfs, tmp_path / "proc")
    for _ in range(5):
        gpu = source.read().gpus[0]
        assert gpu.up and gpu.utilization == 0.4 and gpu.power_watts is None
    sysfs.jetson_orin_sensors()
    readings = [source.read().gpus[0] for _ in range(65)]  # looked for at least once a minute
    assert readings[-1].power_watts == 7.0  # VDD_GPU_SOC: 5000 mV x 1400 mA
    assert readings[-1].temperature_celsius == 43.0  # gpu-thermal
    assert "power rail VDD_GPU_SOC" in source.describe(source.read())


def test_a_missing_rail_is_looked_for_on_a_back_off_not_each_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Jetson samples every second: while the INA3221 driver is unbound (hwmon gone), looking
    for the rail each sample would walk class/hwmon and bus/i2c every second."""
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    hwmon = _ina3221(sysfs)
    source = jetson(sysfs, tmp_path / "proc")
    looks = []
    real = jetson_module._gpu_rail
    monkeypatch.setattr(jetson_module, "_gpu_rail", lambda root: looks.append(1) or real(root))
    device = hwmon.resolve()
    hwmon.unlink()  # the driver unbound: class/hwmon/hwmonN gone
    assert all(source.read().gpus[0].power_watts is None for _ in range(200))
    assert len(looks) <= 10  # after 1, 2, 4, ... 64 s
    sysfs.link(hwmon, device)
    readings = [source.read().gpus[0].power_watts for _ in range(65)]
    assert readings[-1] == 6.0


def test_out_of_range_readings_are_dropped(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    sysfs.write(sysfs.root / "devices" / "platform" / "17000000.ga10b", {"load": 4000})
    sysfs.write(sysfs.root / "devices" / "virtual" / "thermal" / "thermal_zone1", {"temp": -256000})
    (gpu,) = jetson(sysfs, tmp_path / "proc").read().gpus
    assert gpu.utilization is None and gpu.temperature_celsius is None and gpu.up


def test_a_board_below_freezing_reports_its_temperature(tmp_path: Path) -> None:
    """Thermal zones give signed millidegrees; an Orin is rated down to -25 °C."""
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.jetson_orin(tmp_path / "proc")
    sysfs.write(sysfs.root / "devices" / "virtual" / "thermal" / "thermal_zone1", {"temp": -4500})
    (gpu,) = jetson(sysfs, tmp_path / "proc").read().gpus
    assert gpu.temperature_celsius == -4.5


def test_absent_on_other_machines(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.amd_rx7900(0, "0000:03:00.0")
    with pytest.raises(SourceAbsent, match="no Tegra GPU in .*not a Jetson"):
        jetson(sysfs, tmp_path / "proc")
