"""Intel GPUs (i915 and xe drivers) through DRM sysfs and the driver's hwmon.

Neither driver has a busy counter or an instantaneous power file in sysfs:
utilization is not reported, and power is the energy counter's rate between
two samples. Local memory exists on discrete cards only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

from kepler_bridge.config import Config
from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources import ranges
from kepler_bridge.sources.base import Source, SourceAbsent, device_reading
from kepler_bridge.sources.sysfs import (
    DrmCard,
    Hwmon,
    device_hwmon,
    drm_cards,
    read_int,
    read_text,
    runtime_suspended,
    scaled,
)

VENDOR = "intel"
MHZ = 1e6


@dataclass
class _Card:
    """One card and its last energy reading, for power as a rate."""

    drm: DrmCard
    model: str
    driver_version: str
    last_energy: float | None = None
    last_time: float = 0.0

    def power(self, energy: float | None, now: float) -> float | None:
        """Watts since the previous sample; None on the first sample and when the counter went
        back."""
        previous, elapsed = self.last_energy, now - self.last_time
        self.last_energy, self.last_time = energy, now
        if energy is None or previous is None or energy < previous or elapsed <= 0:
            return None
        return ranges.watts((energy - previous) / elapsed)


class IntelSource(Source):
    """Every card bound to i915 or xe; a card that goes away is reported down alone."""

    name = "intel"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.cards: list[_Card] = []

    def start(self) -> None:
        sysfs = self.config.sysfs
        self.cards = [
            _Card(
                card,
                f"Intel GPU {read_text(card.device / 'device') or 'unknown'}",
                read_text(Path(sysfs, "module", card.driver, "version")) or "",
            )
            for card in drm_cards(sysfs, ("i915", "xe"))
        ]
        if not self.cards:
            raise SourceAbsent(
                f"no DRM card bound to the i915 or xe driver in {sysfs}/class/drm: load it "
                "(modprobe i915 or xe); in a pod mount the host's /sys and pass --sysfs /host/sys"
            )

    def read(self) -> SourceReading:
        now = time.monotonic()
        gpus = tuple(self._read_card(index, card, now) for index, card in enumerate(self.cards))
        return device_reading(gpus, "Intel GPU")

    def _read_card(self, index: int, card: _Card, now: float) -> GpuReading:
        drm = card.drm
        identity = _identity(index, card)
        if not drm.present():
            card.last_energy = None
            return replace(
                identity,
                up=False,
                error=f"{drm.name} ({drm.pci_bus_id}) is gone: the card was removed or "
                f"{drm.driver} unbound; check dmesg",
            )
        used, total = _memory(drm)  # the driver's books: they wake nothing
        identity = replace(
            identity,
            memory_used_bytes=used,
            memory_total_bytes=total,
            memory_free_bytes=ranges.free_bytes(total, used),
        )
        if runtime_suspended(drm.device):
            card.last_energy = None  # no rate across the sleep: the counter may restart
            return identity
        mhz = _frequency_mhz(drm)
        # Device-level hwmon only: i915 also registers per-GT ones ("i915_gt0") under the same
        # device.
        hwmon = device_hwmon(drm.device, (drm.driver,))
        energy = (
            ranges.joules(scaled(hwmon.labelled("energy", ("card", "pkg", "energy1")), 1e6))
            if hwmon
            else None
        )
        reading = replace(
            identity,
            energy_joules=energy,
            power_watts=card.power(energy, now),
            sm_clock_hertz=ranges.hertz(mhz * MHZ if mhz is not None else None),
        )
        return replace(reading, **_sensors(hwmon)) if hwmon else reading


def _identity(index: int, card: _Card) -> GpuReading:
    """Who the card is: the fields of its reading that stay the same from sample to sample."""
    drm = card.drm
    # Intel's device plugin names a card by its DRM name (card0-<replica> in pod-resources).
    return GpuReading(
        index=index,
        uuid=f"INTEL-{drm.pci_bus_id}",
        vendor=VENDOR,
        model=card.model,
        driver_version=card.driver_version,
        pci_bus_id=drm.pci_bus_id,
        device_ids=(drm.name,),
        lists_processes=False,
    )


class _Sensors(TypedDict):
    temperature_celsius: float | None
    memory_temperature_celsius: float | None
    power_limit_watts: float | None


def _sensors(hwmon: Hwmon) -> _Sensors:
    """Temperatures (millidegrees; xe labels them pkg and vram) and the PL1 power limit
    (microwatts)."""
    limit = hwmon.value("power1_max")
    return _Sensors(
        temperature_celsius=ranges.celsius(scaled(hwmon.labelled("temp", ("pkg", "temp1")), 1000)),
        memory_temperature_celsius=ranges.celsius(scaled(hwmon.labelled("temp", ("vram",)), 1000)),
        power_limit_watts=ranges.watts(scaled(limit, 1e6)) if limit else None,  # 0 = limit disabled
    )


def _frequency_mhz(drm: DrmCard) -> int | None:
    """Actual GT frequency: i915 has it on the card, xe per GT under the PCI device."""
    if drm.driver == "i915":
        return read_int(drm.path / "gt_act_freq_mhz")
    return read_int(drm.device / "tile0" / "gt0" / "freq0" / "act_freq")


def _memory(drm: DrmCard) -> tuple[int | None, int | None]:
    """(used, total) local memory in bytes; None where the driver does not say."""
    if drm.driver == "xe":
        sizes = [
            read_int(path) for path in sorted(drm.device.glob("tile*/physical_vram_size_bytes"))
        ]
        known = [size for size in sizes if size is not None]
        return None, ranges.byte_count(sum(known)) if known else None
    # i915 builds with local-memory support (discrete cards) publish these on the card.
    total = ranges.byte_count(read_int(drm.path / "lmem_total_bytes"))
    available = ranges.byte_count(read_int(drm.path / "lmem_avail_bytes"))
    if not total:
        return None, None
    return (total - available if available is not None and available <= total else None), total
