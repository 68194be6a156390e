"""kepler-bridge source for Rockchip NPUs: load from the rknpu driver, clock from devfreq.

The rknpu driver prints its load in debugfs (mounted at /sys/kernel/debug, so it follows --sysfs)
as "NPU load:  Core0: 12%, Core1:  0%, Core2:  0%," on three-core NPUs or "NPU load:  12%" on one
core; devfreq's ``cur_freq`` is the NPU clock in hertz. The NPU allocates from system RAM: no
memory is reported.
"""

from __future__ import annotations

import re
from pathlib import Path

from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Source, SourceAbsent
from kepler_bridge.sources.sysfs import read_int, read_text

VENDOR = "rockchip"
_PERCENT = re.compile(r"(\d+)%")
_SOC = re.compile(r"rockchip,(rk\d+)")


class RknpuSource(Source):
    """The one NPU of a Rockchip SoC."""

    name = "rknpu"
    auto = True  # joins `auto`: start() says SourceAbsent on machines without the NPU

    def start(self) -> None:
        sysfs = Path(self.config.sysfs)
        self.load = sysfs / "kernel" / "debug" / "rknpu" / "load"
        self.devfreq = next(iter(sorted((sysfs / "class" / "devfreq").glob("*.npu"))), None)
        if self.devfreq is None and not self.load.exists():
            raise SourceAbsent(
                f"no Rockchip NPU: neither {sysfs}/class/devfreq/*.npu nor {self.load} exists "
                "(load the rknpu driver; mount debugfs and the host's /sys, pass --sysfs)"
            )
        # compatible is a list of NUL-separated strings such as "radxa,rock-5b\0rockchip,rk3588".
        soc = _SOC.search(
            (sysfs / "firmware" / "devicetree" / "base" / "compatible").read_text(errors="replace")
            if (sysfs / "firmware" / "devicetree" / "base" / "compatible").exists()
            else ""
        )
        self.model = f"Rockchip {soc.group(1).upper()} NPU" if soc else "Rockchip NPU"
        self.uuid = f"ROCKCHIP-{self.devfreq.name if self.devfreq else 'rknpu'}"

    def read(self) -> SourceReading:
        cores = [int(percent) for percent in _PERCENT.findall(read_text(self.load) or "")]
        return SourceReading(
            gpus=(
                GpuReading(
                    index=0,
                    uuid=self.uuid,
                    vendor=VENDOR,
                    model=self.model,
                    lists_processes=False,
                    utilization=ranges.ratio_from_percent(sum(cores) / len(cores))
                    if cores
                    else None,
                    sm_clock_hertz=ranges.hertz(read_int(self.devfreq / "cur_freq"))
                    if self.devfreq
                    else None,
                ),
            )
        )
