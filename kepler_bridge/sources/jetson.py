"""NVIDIA Jetson (Tegra) integrated GPU: devfreq load and clock, INA3221 power rails, thermal
zones, shared RAM.

The GPU has no memory of its own: it allocates from system RAM, so memory is
reported as the RAM it can use (MemTotal) and the RAM in use (MemTotal -
MemAvailable) from /proc/meminfo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kepler_bridge.config import Config
from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Retry, Source, SourceAbsent
from kepler_bridge.sources.sysfs import class_hwmons, read_int, read_text, scaled, whole_number

VENDOR = "nvidia"
# Device-tree node names of Tegra GPUs: gp10b (TX2), gv11b (Xavier), ga10b (Orin), gpu (Nano;
# Orin on JetPack 6).
GPU_NODES = ("gp10b", "gv11b", "ga10b", "gpu")
GPU_THERMAL_ZONES = ("gpu-therm", "gpu-thermal")
LOAD_FULL_SCALE = 1000  # the devfreq device's `load` is per mille
# The most seconds between two looks for a missing rail or zone: its driver probes after the agent
# starts (drivers come up in any order at boot), or it was unbound.
MAX_SEARCH_WAIT = 64.0


@dataclass(frozen=True)
class _Rail:
    """One INA3221 channel: hwmon (millivolts and milliamperes) or the older iio driver
    (milliwatts)."""

    label: str
    files: tuple[Path, ...]
    label_file: Path  # where the driver names the channel: checked each read

    def here(self) -> bool:
        """Whether the channel is still this rail: hwmon devices are numbered anew when the driver
        loads again, and another chip's channel may take these paths."""
        return read_text(self.label_file) == self.label

    def watts(self) -> float | None:
        read = [read_int(path) for path in self.files]
        values = [value for value in read if value is not None]
        if len(values) < len(read):
            return None
        if len(values) == 1:
            return values[0] / 1e3
        millivolts, milliamperes = values
        return millivolts * milliamperes / 1e6


class JetsonSource(Source):
    """The one integrated GPU of a Jetson module."""

    name = "jetson"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.devfreq = Path()
        self.rail: _Rail | None = None
        self.thermal: Path | None = None
        self.rail_search = Retry(MAX_SEARCH_WAIT)
        self.thermal_search = Retry(MAX_SEARCH_WAIT)
        self.clock = time.monotonic

    def start(self) -> None:
        sysfs = Path(self.config.sysfs)
        found = [
            entry
            for entry in sorted((sysfs / "class" / "devfreq").glob("*"))
            if read_text(entry / "device" / "of_node" / "name") in GPU_NODES
        ]
        if not found:
            raise SourceAbsent(
                f"no Tegra GPU in {sysfs}/class/devfreq (device-tree node "
                f"{', '.join(GPU_NODES)}): not a Jetson; in a pod mount the host's /sys and pass "
                "--sysfs /host/sys"
            )
        self.devfreq = found[0]
        devicetree = sysfs / "firmware" / "devicetree" / "base"
        serial = read_text(devicetree / "serial-number")
        self.uuid = f"JETSON-{serial or self.devfreq.name}"
        self.model = read_text(devicetree / "model") or "NVIDIA Jetson"
        self._find_sensors()

    def _find_sensors(self) -> None:
        """Find the GPU's rail and thermal zone where missing (or the rail's channel taken by
        another), looking again on a back-off (`Retry`), never each sample."""
        now = self.clock()
        if self.rail is not None and not self.rail.here():
            self.rail = None  # its channel is another rail's now: looked for again at once
        if self.rail is None and self.rail_search.due(now):
            self.rail = _gpu_rail(self.config.sysfs)  # None (no power) until it is back
            self._looked(self.rail_search, self.rail is not None, now)
        if self.thermal is None and self.thermal_search.due(now):
            self.thermal = _gpu_zone(self.config.sysfs)
            self._looked(self.thermal_search, self.thermal is not None, now)

    def _looked(self, search: Retry, found: bool, now: float) -> None:
        if found:
            search.succeeded()
        else:
            search.failed(self.config.interval, now)

    def read(self) -> SourceReading:
        self._find_sensors()
        load = read_int(self.devfreq / "device" / "load")
        used, total = _shared_memory(self.config.procfs)
        return SourceReading(
            gpus=(
                GpuReading(
                    index=0,
                    uuid=self.uuid,
                    vendor=VENDOR,
                    model=self.model,
                    lists_processes=False,
                    utilization=ranges.ratio(load / LOAD_FULL_SCALE if load is not None else None),
                    sm_clock_hertz=ranges.hertz(read_int(self.devfreq / "cur_freq")),
                    memory_used_bytes=used,
                    memory_total_bytes=total,
                    memory_free_bytes=ranges.free_bytes(total, used),
                    power_watts=ranges.watts(self.rail.watts()) if self.rail else None,
                    temperature_celsius=ranges.celsius(
                        scaled(read_int(self.thermal / "temp"), 1000)
                    )
                    if self.thermal
                    else None,
                ),
            )
        )

    def describe(self, reading: SourceReading) -> str:
        rail = f"power rail {self.rail.label}" if self.rail else "no GPU power rail"
        return f"{super().describe(reading)}; GPU {self.devfreq.name}, {rail}"


def _rails(sysfs: str) -> list[_Rail]:
    """Every labelled INA3221 channel: hwmon driver (JetPack 5+) and iio driver (JetPack 4)."""
    rails = []
    for hwmon in class_hwmons(sysfs, "ina3221"):
        for label, channel in hwmon.channels("in").items():
            number = channel.removeprefix("in")
            current = hwmon.path / f"curr{number}_input"
            if label != channel and current.exists():  # in4..in7 are unlabelled shunt voltages
                files = (hwmon.path / f"{channel}_input", current)
                rails.append(_Rail(label, files, hwmon.path / f"{channel}_label"))
    for name_file in sorted(Path(sysfs, "bus", "i2c", "devices").glob("*/iio:device*/rail_name_*")):
        number = name_file.name.removeprefix("rail_name_")
        rails.append(
            _Rail(
                read_text(name_file) or name_file.name,
                (name_file.with_name(f"in_power{number}_input"),),
                name_file,
            )
        )
    return rails


def _gpu_rail(sysfs: str) -> _Rail | None:
    """The GPU's rail without the CPU (GPU, VDD_SYS_GPU, POM_5V_GPU; AGX Orin's VDD_GPU_SOC feeds
    the SoC too); else one shared with the CPU (VDD_CPU_GPU_CV)."""
    rails = [rail for rail in _rails(sysfs) if "GPU" in rail.label.upper()]
    return next(
        (rail for rail in rails if "CPU" not in rail.label.upper()), rails[0] if rails else None
    )


def _gpu_zone(sysfs: str) -> Path | None:
    """The GPU's thermal zone: GPU-therm (JetPack 4, Xavier on 5) or gpu-thermal (Orin)."""
    return next(
        (
            zone
            for zone in sorted(Path(sysfs, "class", "thermal").glob("thermal_zone*"))
            if (read_text(zone / "type") or "").lower() in GPU_THERMAL_ZONES
        ),
        None,
    )


def _shared_memory(procfs: str) -> tuple[int | None, int | None]:
    """(used, total) system RAM in bytes from meminfo."""
    fields: dict[str, int] = {}
    for line in (read_text(Path(procfs, "meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        kib = whole_number(words[0]) if words else None
        if kib is not None and kib >= 0:
            fields[key] = kib * 1024  # meminfo counts in kB (KiB)
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if total is None or available is None or available > total:
        return None, total
    return ranges.byte_count(total - available), ranges.byte_count(total)
