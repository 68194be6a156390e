"""Huawei Ascend NPUs from the table `npu-smi info` prints.

Atlas 200/300/800 with 310, 310B, 310P, 910, 910B. Each chip takes two table rows:
"NPU Name | Health | Power(W) Temp(C) Hugepages-Usage(page)" and
"Chip [Device] | Bus-Id | AICore(%) Memory-Usage(MB) [HBM-Usage(MB)]". Device memory is HBM where
the chip has it (910 series; Memory-Usage there is the control CPU's DDR), else Memory-Usage.
"NA" reads as cannot report.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass

from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources import ranges, runner
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable
from kepler_bridge.sources.sysfs import on_pci_bus, whole_number

VENDOR = "huawei"
MIB = 1024 * 1024
HUAWEI_PCI_VENDOR = "0x19e5"
PROCESSING_ACCELERATOR_CLASS = "0x1200"  # PCI class 12h subclass 00h: processing accelerator
SEARCH_DIRS = ("/usr/local/sbin", "/usr/local/bin")  # where the Ascend driver installs npu-smi
# Health words of npu-smi: OK, Warning (minor), Alarm (major), Critical (urgent). Only Critical
# takes a chip down: Atlas 200I boards report Alarm in normal operation, and hiding their memory
# would help nobody.
DOWN_HEALTH = ("Critical",)

_VERSION = re.compile(r"Version:\s*(\S+)")
_USAGE = re.compile(r"([\d.]+|NA)\s*/\s*([\d.]+|NA)")
_FAMILY = re.compile(r"(\d{3})([BP]?)")


@dataclass(frozen=True)
class Chip:
    """One chip as npu-smi printed it."""

    npu: int
    chip: int
    # The chip's device id: npu-smi's Device column where printed (several chips a card), else
    # the NPU.
    device: int
    name: str
    health: str
    bus_id: str
    power_watts: float | None
    temperature_celsius: float | None
    aicore_percent: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None


class AscendSource(Source):
    """Runs `npu-smi info` each interval (under --command-timeout) and reads every chip from its
    table."""

    name = "ascend"

    def start(self) -> None:
        configured = self.config.npu_smi or "npu-smi"
        found = shutil.which(configured) or next(
            (
                path
                for path in (shutil.which(configured, path=directory) for directory in SEARCH_DIRS)
                if path
            ),
            None,
        )
        if found is None:
            where = "" if "/" in configured else f" in PATH or {', '.join(SEARCH_DIRS)}"
            message = (
                f"{configured} not found{where}: install the Ascend driver, mount the host's "
                "npu-smi and driver libraries into the pod, or pass --npu-smi PATH"
            )
            if on_pci_bus(self.config.sysfs, HUAWEI_PCI_VENDOR, PROCESSING_ACCELERATOR_CLASS):
                raise SourceUnavailable(f"Huawei NPUs are on the PCI bus but {message}")
            raise SourceAbsent(message)
        self.npu_smi = found
        self.driver_version = ""

    def read(self) -> SourceReading:
        text = runner.run((self.npu_smi, "info"), self.config.command_timeout)
        self.driver_version, chips = parse(text)
        if not chips:
            raise RuntimeError(f"{self.npu_smi} info listed no NPU; run it on the host to see why")
        return SourceReading(
            gpus=tuple(self._reading(index, chip) for index, chip in enumerate(chips))
        )

    def describe(self, reading: SourceReading) -> str:
        driver = self.driver_version or "unknown"
        return f"{super().describe(reading)}; driver {driver} ({self.npu_smi})"

    def _reading(self, index: int, chip: Chip) -> GpuReading:
        used = ranges.byte_count(
            int(chip.memory_used_mib * MIB) if chip.memory_used_mib is not None else None
        )
        total = ranges.byte_count(
            int(chip.memory_total_mib * MIB) if chip.memory_total_mib is not None else None
        )
        down = chip.health in DOWN_HEALTH
        return GpuReading(
            index=index,
            uuid=f"ASCEND-{chip.bus_id or f'npu{chip.npu}'}-{chip.chip}",
            vendor=VENDOR,
            model=f"Ascend {_family_name(chip.name)}",
            driver_version=self.driver_version,
            pci_bus_id=chip.bus_id,
            device_ids=_plugin_ids(chip),
            lists_processes=False,
            up=not down,
            error=f"npu-smi health {chip.health}: see `npu-smi info -t health -i {chip.npu}`"
            if down
            else "",
            utilization=ranges.ratio_from_percent(chip.aicore_percent),
            memory_used_bytes=used,
            memory_total_bytes=total,
            memory_free_bytes=ranges.free_bytes(total, used),
            temperature_celsius=ranges.celsius(chip.temperature_celsius),
            power_watts=ranges.watts(chip.power_watts),
        )


def parse(text: str) -> tuple[str, list[Chip]]:
    """The driver version and the chips of an `npu-smi info` table; the process table after it is
    ignored."""
    version = _VERSION.search(text)
    chips = [_chip(*block) for block in _blocks(text) if _is_chip(block)]
    return (version.group(1) if version else ""), chips


def _plugin_ids(chip: Chip) -> tuple[str, ...]:
    """The name Ascend's device plugin gives the chip in pod-resources: Ascend910-<id> (910
    series), Ascend310P-<id>."""
    family = _FAMILY.match(_family_name(chip.name))
    if family is None:
        return ()
    digits, letter = family.groups()
    return (f"Ascend{digits}{letter if digits == '310' else ''}-{chip.device}",)


def _family_name(name: str) -> str:
    """The chip's name without the "Ascend" newer npu-smi puts before it (Atlas A3: Ascend910)."""
    return name.removeprefix("Ascend").lstrip()


def _blocks(text: str) -> list[list[list[str]]]:
    """Runs of table rows between separator lines, each row as its cells."""
    blocks: list[list[list[str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|"):
            blocks[-1].append([cell.strip() for cell in line.strip("|").split("|")])
        elif blocks[-1]:
            blocks.append([])
    return blocks


def _is_chip(block: list[list[str]]) -> bool:
    """Two rows of three cells: "<npu> <name>" over "<chip> [<device>]" (headers and processes do
    not fit)."""
    if len(block) != 2 or any(len(row) != 3 for row in block):
        return False
    head, status = block[0][0].split(), block[1][0].split()
    return (
        len(head) == 2
        and whole_number(head[0]) is not None
        and bool(status)
        and whole_number(status[0]) is not None
    )


def _chip(first: list[str], second: list[str]) -> Chip:
    npu, name = first[0].split()
    power_temp = first[2].split()
    usages = _USAGE.findall(second[2])
    # HBM-Usage, when printed and non-zero, follows Memory-Usage and is the device's own memory.
    hbm = usages[1] if len(usages) > 1 and _number(usages[1][1]) else None
    used, total = hbm or (usages[0] if usages else (None, None))
    aicore = second[2].split()
    chip_device = second[0].split()
    return Chip(
        npu=int(npu),
        chip=int(chip_device[0]),
        device=int(chip_device[1])
        if len(chip_device) > 1 and whole_number(chip_device[1]) is not None
        else int(npu),
        name=name,
        health=first[1],
        bus_id="" if second[1] in ("", "NA") else second[1],
        power_watts=_number(power_temp[0]) if power_temp else None,
        temperature_celsius=_number(power_temp[1]) if len(power_temp) > 1 else None,
        aicore_percent=_number(aicore[0]) if aicore else None,
        memory_used_mib=_number(used),
        memory_total_mib=_number(total),
    )


def _number(text: str | None) -> float | None:
    """A finite number npu-smi printed, else None."""
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is None or math.isfinite(value) else None
