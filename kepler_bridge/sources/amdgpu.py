"""AMD GPUs through the amdgpu driver's sysfs files and its hwmon (kernel docs: gpu/amdgpu)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

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
    whole_number,
)

VENDOR = "amd"
PWM_MAX = 255  # pwm1 range when pwm1_max is absent


@dataclass(frozen=True)
class _Card:
    """What does not change while the card is bound: its identity."""

    drm: DrmCard
    uuid: str
    model: str


class AmdgpuSource(Source):
    """Every card bound to amdgpu; a card that goes away is reported down alone."""

    name = "amdgpu"

    def start(self) -> None:
        sysfs = self.config.sysfs
        found = drm_cards(sysfs, ("amdgpu",))
        if not found:
            raise SourceAbsent(
                f"no DRM card bound to the amdgpu driver in {sysfs}/class/drm: load it "
                "(modprobe amdgpu); in a pod mount the host's /sys and pass --sysfs /host/sys"
            )
        self.cards = [_Card(card, _uuid(card), _model(card.device)) for card in found]
        self.driver_version = read_text(Path(sysfs, "module", "amdgpu", "version")) or ""

    def read(self) -> SourceReading:
        gpus = tuple(self._read_card(index, card) for index, card in enumerate(self.cards))
        return device_reading(gpus, "AMD GPU")

    def _read_card(self, index: int, card: _Card) -> GpuReading:
        identity = GpuReading(
            index=index,
            uuid=card.uuid,
            vendor=VENDOR,
            model=card.model,
            driver_version=self.driver_version,
            pci_bus_id=card.drm.pci_bus_id,
            lists_processes=False,
        )
        if not card.drm.present():
            return replace(
                identity,
                up=False,
                error=f"{card.drm.name} ({card.drm.pci_bus_id}) is gone: the card was removed or "
                "amdgpu unbound; check dmesg",
            )
        device = card.drm.device
        # The memory files read the driver's books; the others ask the chip.
        used = ranges.byte_count(read_int(device / "mem_info_vram_used"))
        total = ranges.byte_count(read_int(device / "mem_info_vram_total"))
        identity = replace(
            identity,
            memory_used_bytes=used,
            memory_total_bytes=total,
            memory_free_bytes=ranges.free_bytes(total, used),
        )
        if runtime_suspended(device):
            return replace(identity, utilization=0.0, memory_utilization=0.0)
        hwmon = device_hwmon(device, ("amdgpu",))
        corrected, uncorrected = _ecc(device)
        reading = replace(
            identity,
            utilization=ranges.ratio_from_percent(read_int(device / "gpu_busy_percent")),
            memory_utilization=ranges.ratio_from_percent(read_int(device / "mem_busy_percent")),
            ecc_corrected_total=corrected,
            ecc_uncorrected_total=uncorrected,
        )
        return replace(reading, **_sensors(hwmon)) if hwmon else reading


class _Sensors(TypedDict):
    temperature_celsius: float | None
    memory_temperature_celsius: float | None
    power_watts: float | None
    power_limit_watts: float | None
    energy_joules: float | None
    sm_clock_hertz: float | None
    memory_clock_hertz: float | None
    fan_speed_ratio: float | None


def _sensors(hwmon: Hwmon) -> _Sensors:
    """Temperatures (millidegrees), power (microwatts), clocks (Hz), fan and energy
    (microjoules)."""
    power = hwmon.value("power1_average")
    if power is None:
        power = hwmon.value("power1_input")
    # An APU's power (and cap) is the SoC's, CPU cores included, which RAPL counts already (the
    # kernel's amdgpu thermal doc); only APUs have the vddnb rail.
    apu = "vddnb" in hwmon.channels("in")
    return _Sensors(
        # MI-series cards have no edge sensor: their junction sensor is the core temperature.
        temperature_celsius=ranges.celsius(
            scaled(hwmon.labelled("temp", ("edge", "junction", "temp1")), 1000)
        ),
        memory_temperature_celsius=ranges.celsius(scaled(hwmon.labelled("temp", ("mem",)), 1000)),
        power_watts=None if apu else ranges.watts(scaled(power, 1e6)),
        power_limit_watts=None if apu else ranges.watts(scaled(hwmon.value("power1_cap"), 1e6)),
        energy_joules=None if apu else ranges.joules(scaled(hwmon.value("energy1_input"), 1e6)),
        sm_clock_hertz=ranges.hertz(hwmon.labelled("freq", ("sclk", "freq1"))),
        memory_clock_hertz=ranges.hertz(hwmon.labelled("freq", ("mclk", "freq2"))),
        fan_speed_ratio=_fan(hwmon),
    )


def _fan(hwmon: Hwmon) -> float | None:
    pwm = hwmon.value("pwm1")
    if pwm is not None:
        return ranges.ratio(pwm / (hwmon.value("pwm1_max") or PWM_MAX))
    rpm, rpm_max = hwmon.value("fan1_input"), hwmon.value("fan1_max")
    return ranges.ratio(rpm / rpm_max) if rpm is not None and rpm_max else None


def _ecc(device: Path) -> tuple[int | None, int | None]:
    """Memory (UMC) error counts from ras/umc_err_count: lines "ue: N" and "ce: N"."""
    counts: dict[str, int] = {}
    for line in (read_text(device / "ras" / "umc_err_count") or "").splitlines():
        key, _, value = line.partition(":")
        count = whole_number(value)
        if count is not None and count >= 0:
            counts[key.strip()] = count
    return counts.get("ce"), counts.get("ue")


def _uuid(card: DrmCard) -> str:
    """The ASIC's unique_id where the driver has one, else the PCI address."""
    unique = read_text(card.device / "unique_id")
    return f"AMD-{unique}" if unique else f"AMD-{card.pci_bus_id}"


def _model(device: Path) -> str:
    """product_name (from the board's FRU, server cards) or the PCI device id."""
    return (
        read_text(device / "product_name") or f"AMD GPU {read_text(device / 'device') or 'unknown'}"
    )
