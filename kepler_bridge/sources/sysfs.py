"""Reading sysfs one way for every source: single values, DRM cards and hwmon channels.

A file that is missing or that the driver refuses to read (EIO, EINVAL while a
device sleeps) reads as None: the value is "cannot report" for that sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_CARD = re.compile(r"card(\d+)")
# A decimal integer as drivers print one: ASCII digits, at most 20 (2**64 has 20). Python's int()
# takes more (underscores, other scripts' digits, thousands of digits), which overflows later.
_INT = re.compile(r"[+-]?[0-9]{1,20}")


def read_text(path: Path) -> str | None:
    """The file's text without surrounding whitespace or the NULs that end device-tree strings."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip().strip("\x00").strip()
    except OSError:
        return None


def runtime_suspended(device: Path) -> bool:
    """Whether the PCI device is runtime-suspended (an idle dGPU of a laptop or a PRIME box):
    reading what asks the chip (busy percents, hwmon, RAS, an xe GT's frequency) would wake it,
    every sample, for good. power/runtime_status wakes nothing; anything but "suspended" (active,
    unsupported on an APU, no file) is awake."""
    return read_text(device / "power" / "runtime_status") == "suspended"


def read_int(path: Path) -> int | None:
    """A file holding one decimal integer."""
    return whole_number(read_text(path))


def whole_number(text: str | None) -> int | None:
    """The decimal integer `text` holds (blanks around it allowed), or None."""
    text = None if text is None else text.strip()
    return int(text) if text and _INT.fullmatch(text) else None


def scaled(value: int | None, divisor: float) -> float | None:
    """value / divisor, for sysfs units such as millidegrees or microwatts."""
    return None if value is None else value / divisor


@dataclass(frozen=True)
class DrmCard:
    """A DRM card (``class/drm/cardN``) and the PCI device behind it."""

    name: str
    path: Path
    device: Path
    driver: str

    @property
    def pci_bus_id(self) -> str:
        return self.device.name

    def present(self) -> bool:
        """False once the device is removed or its driver unbound (the card directory goes away)."""
        return self.path.is_dir()


def drm_cards(sysfs: str, drivers: tuple[str, ...]) -> list[DrmCard]:
    """The DRM cards bound to one of these kernel drivers, in card-number order."""
    root = Path(sysfs, "class", "drm")
    if not root.is_dir():
        return []
    cards = []
    for entry in sorted(root.iterdir(), key=lambda path: _card_number(path.name)):
        if not _CARD.fullmatch(entry.name):
            continue
        device = (entry / "device").resolve()
        driver = (device / "driver").resolve().name if (device / "driver").exists() else ""
        if driver in drivers:
            cards.append(DrmCard(entry.name, entry, device, driver))
    return cards


def on_pci_bus(sysfs: str, vendor: str, class_prefix: str) -> bool:
    """Whether a PCI function of this vendor (e.g. "0x10de") whose class code starts with
    class_prefix is present."""
    for device in Path(sysfs, "bus", "pci", "devices").glob("*"):
        if read_text(device / "vendor") == vendor and (
            read_text(device / "class") or ""
        ).startswith(class_prefix):
            return True
    return False


def _card_number(name: str) -> int:
    match = _CARD.fullmatch(name)
    return int(match.group(1)) if match else -1


@dataclass(frozen=True)
class Hwmon:
    """One hwmon directory: values in the hwmon sysfs ABI's units (milli-, micro-)."""

    path: Path

    def value(self, attribute: str) -> int | None:
        """One attribute, as an integer in its ABI unit."""
        return read_int(self.path / attribute)

    def channels(self, kind: str) -> dict[str, str]:
        """Channels of one kind ("temp", "energy", "in", ...) by label: {"edge": "temp1", ...}.

        A channel without a ``_label`` file is known by its own name ("temp1").
        """
        found: dict[str, str] = {}
        for entry in sorted(
            self.path.glob(f"{kind}*_input"), key=lambda path: _channel_number(path.name, kind)
        ):
            channel = entry.name.removesuffix("_input")
            if re.fullmatch(rf"{kind}\d+", channel):
                found.setdefault(read_text(self.path / f"{channel}_label") or channel, channel)
        return found

    def labelled(self, kind: str, labels: tuple[str, ...]) -> int | None:
        """The value of the first channel whose label is in labels (in that order of preference)."""
        channels = self.channels(kind)
        for label in labels:
            if label in channels:
                return self.value(f"{channels[label]}_input")
        return None


def _channel_number(name: str, kind: str) -> int:
    match = re.match(rf"{kind}(\d+)_", name)
    return int(match.group(1)) if match else -1


def device_hwmon(device: Path, names: tuple[str, ...]) -> Hwmon | None:
    """The hwmon directory under a device whose ``name`` is one of names."""
    for path in sorted((device / "hwmon").glob("hwmon*")):
        if read_text(path / "name") in names:
            return Hwmon(path)
    return None


def class_hwmons(sysfs: str, name: str) -> list[Hwmon]:
    """Every ``class/hwmon`` directory whose ``name`` is name (for sensors not tied to a DRM
    card)."""
    return [
        Hwmon(path)
        for path in sorted(Path(sysfs, "class", "hwmon").glob("hwmon*"))
        if read_text(path / "name") == name
    ]
