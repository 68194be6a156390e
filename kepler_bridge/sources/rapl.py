"""Node CPU energy from the RAPL powercap zones in sysfs, and the node's CPU time from /proc/stat.

Zones are ``<sysfs>/class/powercap/{intel-rapl,amd-rapl,intel-rapl-mmio}:N[:M]``
(subzones also nested in their parent's directory). A zone whose name an
earlier interface already gave (intel-rapl-mmio repeats intel-rapl's
package-0) is the same counter and is skipped. Counters are passed on raw:
the attribution handles wrap-around at ``max_energy_range_uj``. Without RAPL
(virtual machines, ARM boards) the source is absent, unless ``cpu_tdp_watts``
asks for an estimate: it then reports only the CPU time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kepler_bridge.config import Config
from kepler_bridge.model import RaplZone, SourceReading
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable
from kepler_bridge.sources.procfs import read_cpu_times

INTERFACES = ("intel-rapl", "amd-rapl", "intel-rapl-mmio")
_ZONE_DIR = re.compile(r"^(intel-rapl-mmio|intel-rapl|amd-rapl):(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class ZoneFile:
    """Where one zone's counter lives and what it is."""

    id: str
    zone: str
    energy_path: str
    max_energy_range_uj: int


def zone_kind(name: str) -> str:
    """The zone's kind from its sysfs name: package-0 and, on parts with several dies per package,
    package-0-die-1 (the kernel's package-%d-die-%d) -> package; core, dram, psys stay."""
    return re.sub(r"-\d+(?:-die-\d+)?$", "", name.strip())


def _sort_key(directory: str) -> tuple[int, int, int]:
    """Interfaces in INTERFACES order, then zone and subzone number; a parent before its
    subzones."""
    match = _ZONE_DIR.match(directory)
    assert match is not None  # only directories that match are zones
    interface, zone, subzone = match.groups()
    return INTERFACES.index(interface), int(zone), int(subzone or -1)


def _listdir(path: Path) -> list[Path]:
    try:
        return [path / name for name in os.listdir(path)]
    except OSError:
        return []


def discover(sysfs: str) -> list[ZoneFile]:
    """Every RAPL zone under sysfs, each physical counter once."""
    found: dict[str, Path] = {}
    for entry in _listdir(Path(sysfs, "class", "powercap")):
        for path in (entry, *(_listdir(entry) if entry.is_dir() else ())):
            if _ZONE_DIR.match(path.name) and (path / "energy_uj").is_file():
                found.setdefault(path.name, path)
    zones: list[ZoneFile] = []
    names: dict[str, str] = {}
    taken: set[tuple[str, str]] = set()
    for directory in sorted(found, key=_sort_key):
        path = found[directory]
        try:
            name = (path / "name").read_text().strip()
            max_range = int((path / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        names[directory] = name
        parent = names.get(directory.rsplit(":", 1)[0], "") if directory.count(":") == 2 else ""
        if (parent, name) in taken:
            continue
        taken.add((parent, name))
        zones.append(ZoneFile(directory, zone_kind(name), str(path / "energy_uj"), max_range))
    return zones


class RaplSource(Source):
    """Raw RAPL energy counters of every zone plus the node's CPU time, for CPU energy
    attribution."""

    name = "rapl"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.zones: list[ZoneFile] = []

    def start(self) -> None:
        root = f"{self.config.sysfs}/class/powercap"
        self.zones = discover(self.config.sysfs)
        if not self.zones and not self.config.cpu_tdp_watts:
            raise SourceAbsent(
                f"no RAPL energy zones under {root} (virtual machines and ARM boards have none; "
                "on an Intel or AMD host load the intel_rapl_msr module, and in a pod mount the "
                "host's /sys and pass --sysfs): CPU energy series are absent; set cpu_tdp_watts "
                "to export an estimate"
            )
        for zone in self.zones:
            try:
                Path(zone.energy_path).read_text()
            except PermissionError:
                raise SourceUnavailable(
                    f"cannot read {zone.energy_path}: since Linux 5.10 RAPL counters are "
                    "readable by root only; run the agent as root (in Kubernetes: "
                    "securityContext.privileged: true)"
                ) from None
        try:
            read_cpu_times(self.config.procfs)
        except (OSError, ValueError) as err:
            raise SourceUnavailable(
                f"cannot read the node's CPU time: {err}; mount the host's /proc and pass --procfs"
            ) from None

    def read(self) -> SourceReading:
        zones = tuple(
            RaplZone(
                zone.id,
                zone.zone,
                int(Path(zone.energy_path).read_text()),
                zone.max_energy_range_uj,
            )
            for zone in self.zones
        )
        return SourceReading(rapl_zones=zones, cpu_times=read_cpu_times(self.config.procfs))

    def describe(self, reading: SourceReading) -> str:
        if not self.zones:
            return (
                f"no RAPL zones under {self.config.sysfs}/class/powercap; estimating CPU power as "
                f"cpu_tdp_watts={self.config.cpu_tdp_watts:g} W x CPU usage"
            )
        kinds = sorted({zone.zone for zone in self.zones})
        where = f"{self.config.sysfs}/class/powercap"
        return f"{len(self.zones)} RAPL zone(s) under {where}: {', '.join(kinds)}"
