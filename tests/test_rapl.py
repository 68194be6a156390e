"""The rapl source on fixture powercap trees: zones, subzones, duplicates, wrap-around, absence,
permissions."""

from __future__ import annotations

import pathlib
from pathlib import Path

import pytest

from kepler_bridge.sampling.attribution import Attribution, SampleInputs
from kepler_bridge.sampling.slots import check_source
from kepler_bridge.sources.base import SourceAbsent, SourceUnavailable
from kepler_bridge.sources.procfs import CLOCK_TICKS, read_cpu_times
from kepler_bridge.sources.rapl import RaplSource
from powercap import PowercapTree
from scaffold import make_config


def procfs(tmp_path: Path, busy: int = 100, idle: int = 300) -> Path:
    """A procfs root whose stat has busy (user) and idle jiffies."""
    root = tmp_path / "proc"
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(
        f"cpu  {busy} 0 0 {idle} 0 0 0 7 0 0\ncpu0 {busy} 0 0 {idle} 0 0 0 7 0 0\n"
    )
    return root


def two_socket_tree(sysfs: Path) -> PowercapTree:
    tree = PowercapTree(sysfs)
    tree.zone("intel-rapl:0", "package-0", 1_000_000)
    tree.zone("intel-rapl:0:0", "core", 400_000)
    tree.zone("intel-rapl:0:1", "dram", 200_000)
    tree.zone("intel-rapl:1", "package-1", 2_000_000)
    tree.zone("intel-rapl:1:0", "core", 500_000)
    tree.zone("intel-rapl:2", "psys", 9_000_000)
    tree.zone("intel-rapl-mmio:0", "package-0", 1_000_123)  # the same package through MMIO: skipped
    return tree


def test_every_zone_and_subzone_once(tmp_path: Path) -> None:
    two_socket_tree(tmp_path / "sys")
    source = RaplSource(make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path)))
    source.start()
    reading = source.read()
    assert [(z.id, z.zone, z.energy_uj) for z in reading.rapl_zones] == [
        ("intel-rapl:0", "package", 1_000_000),
        ("intel-rapl:0:0", "core", 400_000),
        ("intel-rapl:0:1", "dram", 200_000),
        ("intel-rapl:1", "package", 2_000_000),
        ("intel-rapl:1:0", "core", 500_000),
        ("intel-rapl:2", "psys", 9_000_000),
    ]
    assert reading.cpu_times.busy_seconds == pytest.approx(100 / CLOCK_TICKS)
    assert reading.cpu_times.total_seconds == pytest.approx(
        400 / CLOCK_TICKS
    )  # steal belongs to neither
    assert "6 RAPL zone(s)" in source.describe(reading) and "dram" in source.describe(reading)


def test_the_dies_of_a_package_are_package_zones(tmp_path: Path) -> None:
    """Parts with several dies per package (Cascade Lake-AP) name a zone per die."""
    tree = PowercapTree(tmp_path / "sys")
    for number, name in enumerate(("package-0-die-0", "package-0-die-1", "package-1-die-0")):
        tree.zone(f"intel-rapl:{number}", name, 1_000_000 * (number + 1))
    tree.zone("intel-rapl:0:0", "dram", 200_000)
    source = RaplSource(make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path)))
    source.start()
    assert [zone.zone for zone in source.read().rapl_zones] == [
        "package",
        "dram",
        "package",
        "package",
    ]


def test_amd_rapl_zones(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("amd-rapl:0", "package-0", 5)
    tree.zone("amd-rapl:0:0", "core", 3)
    source = RaplSource(make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path)))
    source.start()
    assert [(z.id, z.zone) for z in source.read().rapl_zones] == [
        ("amd-rapl:0", "package"),
        ("amd-rapl:0:0", "core"),
    ]


def test_sockets_summed_per_zone_and_wrap_around_handled(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("intel-rapl:0", "package-0", 990_000_000, max_energy_range_uj=1_000_000_000)
    tree.zone("intel-rapl:1", "package-1", 0, max_energy_range_uj=1_000_000_000)
    proc = procfs(tmp_path, busy=0, idle=0)
    source = RaplSource(make_config(sysfs=tmp_path / "sys", procfs=proc))
    source.start()
    attribution = Attribution()
    zones = lambda energy: {z.zone: z.joules for z in energy.cpu_zones}  # noqa: E731
    energy = attribution.update(SampleInputs(0.0, source.read().rapl_zones))
    assert zones(energy) == {"package": 0.0}
    tree.advance("intel-rapl:0", 30.0)  # 990 J + 30 J wraps at 1000 J to 20 J
    tree.advance("intel-rapl:1", 5.0)
    assert tree.get("intel-rapl:0") < 990_000_000
    energy = attribution.update(SampleInputs(1.0, source.read().rapl_zones))
    assert zones(energy) == {"package": pytest.approx(35.0)}
    tree.advance("intel-rapl:0", 1.5)
    energy = attribution.update(SampleInputs(2.0, source.read().rapl_zones))
    assert zones(energy) == {"package": pytest.approx(36.5)}


def test_a_reset_counter_is_not_taken_for_a_wrap(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("intel-rapl:0", "package-0", 200_000_000_000)
    source = RaplSource(make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path)))
    source.start()
    attribution = Attribution()
    attribution.update(SampleInputs(0.0, source.read().rapl_zones))
    tree.set("intel-rapl:0", 3_000_000)  # module reloaded: a "wrap" would mean 62 kJ in one second
    energy = attribution.update(SampleInputs(1.0, source.read().rapl_zones))
    assert energy.cpu_zones[0].joules == pytest.approx(3.0)


def test_absent_without_rapl_says_why_and_how_to_estimate(tmp_path: Path) -> None:
    (tmp_path / "sys" / "class" / "powercap").mkdir(parents=True)
    cfg = make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path))
    with pytest.raises(SourceAbsent, match="no RAPL energy zones under .*set cpu_tdp_watts"):
        RaplSource(cfg).start()
    ok, line = check_source("rapl", cfg)
    assert not ok and "virtual machines and ARM boards" in line


def test_estimate_only_when_configured(tmp_path: Path) -> None:
    cfg = make_config(sysfs=tmp_path / "missing", procfs=procfs(tmp_path), cpu_tdp_watts=65)
    ok, line = check_source("rapl", cfg)
    assert ok and "cpu_tdp_watts=65 W" in line
    source = RaplSource(cfg)
    source.start()
    reading = source.read()
    assert reading.rapl_zones == () and reading.cpu_times is not None


def test_root_only_counters_give_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    two_socket_tree(tmp_path / "sys")
    read_text = pathlib.Path.read_text

    def refuse_energy(self: pathlib.Path, *args, **kwargs) -> str:
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied")
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse_energy)
    with pytest.raises(SourceUnavailable, match="readable by root only; run the agent as root"):
        RaplSource(make_config(sysfs=tmp_path / "sys", procfs=procfs(tmp_path))).start()


def test_real_proc_stat_parses() -> None:
    times = read_cpu_times("/proc")
    assert 0 < times.busy_seconds < times.total_seconds
