"""The example plug-in on a fake Rockchip sysfs tree, and its entry point."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from kepler_bridge_rknpu import RknpuSource

from kepler_bridge.config import load
from kepler_bridge.sources.base import SourceAbsent

PACKAGE = Path(__file__).parent.parent


def rk3588(root: Path, load_text: str) -> Path:
    """devfreq fdab0000.npu, the rknpu load file in debugfs and the board's device-tree
    compatible list."""
    (root / "class" / "devfreq" / "fdab0000.npu").mkdir(parents=True)
    (root / "class" / "devfreq" / "fdab0000.npu" / "cur_freq").write_text("1000000000\n")
    (root / "kernel" / "debug" / "rknpu").mkdir(parents=True)
    (root / "kernel" / "debug" / "rknpu" / "load").write_text(load_text)
    (root / "firmware" / "devicetree" / "base").mkdir(parents=True)
    (root / "firmware" / "devicetree" / "base" / "compatible").write_bytes(
        b"radxa,rock-5b\0rockchip,rk3588\0"
    )
    return root


def source(sysfs: Path) -> RknpuSource:
    npu = RknpuSource(load({"sysfs": str(sysfs)}, {}))
    npu.start()
    return npu


def test_three_core_load_is_averaged(tmp_path: Path) -> None:
    (npu,) = (
        source(rk3588(tmp_path, "NPU load:  Core0: 30%, Core1: 60%, Core2:  0%,\n")).read().gpus
    )
    assert (npu.vendor, npu.model, npu.uuid) == (
        "rockchip",
        "Rockchip RK3588 NPU",
        "ROCKCHIP-fdab0000.npu",
    )
    assert npu.utilization == pytest.approx(0.3)
    assert npu.sm_clock_hertz == 1e9
    assert npu.memory_total_bytes is None


def test_unreadable_load_is_not_reported(tmp_path: Path) -> None:
    sysfs = rk3588(tmp_path, "")
    (sysfs / "kernel" / "debug" / "rknpu" / "load").unlink()
    (npu,) = source(sysfs).read().gpus
    assert npu.utilization is None and npu.sm_clock_hertz == 1e9


def test_absent_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(SourceAbsent, match="no Rockchip NPU"):
        source(tmp_path)


def test_the_entry_point_names_the_source() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["kepler_bridge.sources"] == {
        "rknpu": "kepler_bridge_rknpu:RknpuSource"
    }
    assert RknpuSource.name == "rknpu" and RknpuSource.auto
