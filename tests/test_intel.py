"""The intel source (i915 and xe) on fake sysfs trees laid out as the drivers' ABI documents say."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import Agent
from fixtures.sysfs import GIB, FakeSysfs, record_reads
from kepler_bridge.sources import intel
from kepler_bridge.sources.base import SourceAbsent
from scaffold import make_config


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


@pytest.mark.e2e
def test_i915_xe_and_integrated_cards_in_contract_units(sysfs: FakeSysfs) -> None:
    sysfs.intel_dg2_i915(0, "0000:05:00.0")
    sysfs.intel_bmg_xe(1, "0000:06:00.0")
    sysfs.intel_igpu(2, "0000:00:02.0")
    sysfs.amd_rx7900(3, "0000:03:00.0")
    with Agent("--sources", "intel", "--sysfs", str(sysfs.root), "--interval", "0.25s") as agent:
        text = agent.metrics()
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0, "2": 1.0}
        # i915 local memory: lmem_total_bytes and lmem_avail_bytes on the card;
        # xe: per-tile VRAM size only.
        assert agent.samples("gpu_memory_total_bytes") == {"0": 16 * GIB, "1": 12 * GIB}
        assert agent.samples("gpu_memory_used_bytes") == {"0": 4 * GIB}
        assert agent.samples("gpu_sm_clock_hertz") == {"0": 2.4e9, "1": 2.85e9, "2": 1.3e9}
        # energy1_input (µJ); on xe the channel labelled "card", not "pkg".
        assert agent.samples("gpu_energy_joules_total") == {"0": 5000.0, "1": 2.0}
        # xe's labelled sensors; i915 has none on this card.
        assert agent.samples("gpu_temperature_celsius") == {"1": 52.0}
        assert agent.samples("gpu_memory_temperature_celsius") == {"1": 61.0}
        # power1_max is PL1 in µW; 0 means the limit is disabled.
        assert agent.samples("gpu_power_limit_watts") == {"0": 190.0}
        assert agent.samples("gpu_utilization_ratio") == {}
        assert (
            'uuid="INTEL-0000:06:00.0",vendor="intel"' in text
            and 'model="Intel GPU 0x56a0"' in text
        )
        body = agent.get("/v1/collect").json()["test-node"]
        assert body["deviceNum"] == 3
        assert body["devices"][0] == {
            "usedMemory": 4 * GIB,
            "totalMemory": 16 * GIB,
            "percent": 0.25,
        }
        assert body["devices"][1] == {"usedMemory": 0, "totalMemory": 12 * GIB, "percent": 0}


def test_power_is_the_energy_counters_rate(
    sysfs: FakeSysfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hwmon = sysfs.intel_dg2_i915(0, "0000:05:00.0")
    clock = iter([100.0, 102.0, 103.0, 104.0])
    monkeypatch.setattr(intel.time, "monotonic", lambda: next(clock))
    source = intel.IntelSource(make_config(sysfs=sysfs.root))
    source.start()
    assert source.read().gpus[0].power_watts is None  # one reading is no rate yet
    sysfs.write(hwmon, {"energy1_input": 5_000_000_000 + 300_000_000})  # +300 J in 2 s
    assert source.read().gpus[0].power_watts == 150.0
    sysfs.write(
        hwmon, {"energy1_input": 1_000_000}
    )  # the counter went back (driver reload): no rate
    assert source.read().gpus[0].power_watts is None
    sysfs.write(hwmon, {"energy1_input": 1_000_000 + 99_999_000_000})  # 99999 W: out of range
    assert source.read().gpus[0].power_watts is None


def test_a_card_that_goes_away_is_down_alone(sysfs: FakeSysfs) -> None:
    sysfs.intel_dg2_i915(0, "0000:05:00.0")
    card = sysfs.intel_igpu(1, "0000:00:02.0")
    source = intel.IntelSource(make_config(sysfs=sysfs.root))
    source.start()
    card.unlink()
    first, second = source.read().gpus
    assert first.up and not second.up and "card1 (0000:00:02.0) is gone" in second.error


def test_a_runtime_suspended_card_is_read_without_waking_it(
    sysfs: FakeSysfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its hwmon (energy, temperatures) and an xe GT's frequency would wake it: a suspended card
    gives its memory only, and its power no rate across the sleep."""
    sysfs.intel_dg2_i915(0, "0000:05:00.0")
    sysfs.intel_bmg_xe(1, "0000:06:00.0")
    devices = [
        sysfs.root / "devices" / "pci0000:00" / bus for bus in ("0000:05:00.0", "0000:06:00.0")
    ]
    source = intel.IntelSource(make_config(sysfs=sysfs.root))
    source.start()
    opened = record_reads(monkeypatch)
    for status in ("active", "suspended", "active"):
        for device in devices:
            sysfs.write(device / "power", {"runtime_status": status})
        opened.clear()
        i915, xe = source.read().gpus
        touched = {Path(path).name for path in opened}
        assert (i915.memory_total_bytes, i915.memory_used_bytes) == (16 * GIB, 4 * GIB)
        assert xe.memory_total_bytes == 12 * GIB
        if status == "suspended":
            assert not touched & {"energy1_input", "act_freq", "temp2_input", "power1_max"}
            assert (i915.energy_joules, xe.sm_clock_hertz, xe.temperature_celsius) == (None,) * 3
        else:
            assert {"energy1_input", "act_freq", "gt_act_freq_mhz"} <= touched
            assert (i915.energy_joules, xe.sm_clock_hertz) == (5000.0, 2.85e9)
        assert i915.power_watts is None  # no rate on a first reading, nor across a sleep


def test_absent_without_an_intel_card(sysfs: FakeSysfs) -> None:
    sysfs.amd_rx7900(0, "0000:03:00.0")
    with pytest.raises(SourceAbsent, match="no DRM card bound to the i915 or xe driver"):
        intel.IntelSource(make_config(sysfs=sysfs.root)).start()
