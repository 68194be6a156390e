"""Any accelerator the agent does not know: a configured executable prints its readings as JSON.

The output is a superset of what a BIE custom accelerator collector returns on
/v1/collect (docs/command-source.md): such a collector's body is accepted as
it is, and each device may add identity and the other metrics in contract units. The executable
runs once each interval.
"""

from __future__ import annotations

import json
import math
import shutil
from typing import Any, Callable

from kepler_bridge.model import MAX_DEVICES, GpuReading, SourceReading
from kepler_bridge.printable import label_text
from kepler_bridge.sources import ranges, runner
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable

DEFAULT_VENDOR = "custom"

_Check = Callable[[float | None], float | None]

# JSON key -> (GpuReading field, range check); the values are in the contract's base units.
NUMBERS: dict[str, tuple[str, _Check]] = {
    "usedMemory": ("memory_used_bytes", ranges.byte_count),
    "totalMemory": ("memory_total_bytes", ranges.byte_count),
    "freeMemory": ("memory_free_bytes", ranges.byte_count),
    "utilization": ("utilization", ranges.ratio),
    "memoryUtilization": ("memory_utilization", ranges.ratio),
    "encoderUtilization": ("encoder_utilization", ranges.ratio),
    "decoderUtilization": ("decoder_utilization", ranges.ratio),
    "temperature": ("temperature_celsius", ranges.celsius),
    "memoryTemperature": ("memory_temperature_celsius", ranges.celsius),
    "power": ("power_watts", ranges.watts),
    "powerLimit": ("power_limit_watts", ranges.watts),
    "energy": ("energy_joules", ranges.joules),
    "coreClock": ("sm_clock_hertz", ranges.hertz),
    "memoryClock": ("memory_clock_hertz", ranges.hertz),
    "fanSpeed": ("fan_speed_ratio", ranges.ratio),
}
TEXTS: dict[str, str] = {
    "uuid": "uuid",
    "vendor": "vendor",
    "model": "model",
    "driverVersion": "driver_version",
    "pciBusId": "pci_bus_id",
    "error": "error",
}
BYTE_FIELDS = {"memory_used_bytes", "memory_total_bytes", "memory_free_bytes"}


class CommandSource(Source):
    """Runs --command each interval, without a shell, under --command-timeout and a 1 MiB output
    cap."""

    name = "command"

    def start(self) -> None:
        argv = self.config.command
        if not argv:
            raise SourceAbsent(
                "no command configured: set --command (KEPLER_BRIDGE_COMMAND, file key command) to "
                "an executable that prints readings as JSON; see docs/command-source.md"
            )
        if shutil.which(argv[0]) is None:
            raise SourceUnavailable(
                f"{argv[0]} is not an executable file: install it or fix --command"
            )

    def read(self) -> SourceReading:
        return SourceReading(
            gpus=parse(runner.run(self.config.command, self.config.command_timeout))
        )

    def describe(self, reading: SourceReading) -> str:
        return f"{super().describe(reading)}; from {self.config.command[0]}"


class OutputError(ValueError):
    """The command's output does not follow the schema; the message points at the offending
    value."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"command output {where}: {problem}; see docs/command-source.md")


def parse(text: str) -> tuple[GpuReading, ...]:
    """Readings from the command's stdout: {"devices": [...]} or a BIE body
    {"<node>": {"devices": [...]}}."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise OutputError(
            "is not JSON", f"line {err.lineno} column {err.colno}: {err.msg}"
        ) from None
    devices = _devices(data)
    readings = tuple(_device(index, device) for index, device in enumerate(devices))
    seen: dict[str, int] = {}
    for reading in readings:
        if reading.uuid in seen:
            raise OutputError(
                f"devices[{reading.index}].uuid",
                f"{reading.uuid!r} repeats devices[{seen[reading.uuid]}]; "
                "give each device its own uuid",
            )
        seen[reading.uuid] = reading.index
    return readings


def _devices(data: Any) -> list[Any]:
    if not isinstance(data, dict):
        raise OutputError("top level", f"expected a JSON object, got {type(data).__name__}")
    if "devices" not in data and len(data) == 1 and isinstance(next(iter(data.values())), dict):
        data = next(iter(data.values()))  # the BIE form: one node name -> its GpuInfo
    devices = data.get("devices")
    if devices is None and "devices" in data:
        return []  # how Go encodes an empty (nil) slice
    if not isinstance(devices, list):
        raise OutputError(
            '"devices"', 'expected a list of device objects: {"devices": [{...}, ...]}'
        )
    if len(devices) > MAX_DEVICES:
        raise OutputError(
            '"devices"',
            f"{len(devices)} devices, more than the {MAX_DEVICES} a source may report; "
            "print only real accelerators",
        )
    return devices


def _device(index: int, device: Any) -> GpuReading:
    where = f"devices[{index}]"
    if not isinstance(device, dict):
        raise OutputError(where, f"expected an object, got {type(device).__name__}")
    values: dict[str, Any] = {}
    for key, (field, check) in NUMBERS.items():
        if device.get(key) is not None:
            values[field] = check(_number(device[key], f"{where}.{key}", field in BYTE_FIELDS))
    for key, field in TEXTS.items():
        if device.get(key) is not None:
            if not isinstance(device[key], str):
                raise OutputError(f"{where}.{key}", f"expected a string, got {device[key]!r}")
            values[field] = label_text(device[key])  # as shown: two uuids that print alike repeat
    up = device.get("up", True)
    if not isinstance(up, bool):
        raise OutputError(f"{where}.up", f"expected true or false, got {up!r}")
    if "memory_free_bytes" not in values:
        values["memory_free_bytes"] = ranges.free_bytes(
            values.get("memory_total_bytes"), values.get("memory_used_bytes")
        )
    vendor = values.pop("vendor", "") or DEFAULT_VENDOR
    return GpuReading(
        index=index,
        uuid=values.pop("uuid", "") or f"{vendor}-{index}",
        vendor=vendor,
        model=values.pop("model", ""),
        up=up,
        lists_processes=False,
        **values,
    )


def _number(value: Any, where: str, whole: bool) -> float | int | None:
    """A JSON number; bytes become integers. NaN and infinities read as "cannot report"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OutputError(where, f"expected a number, got {value!r}")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return None  # beyond any counter: float() of it would overflow
    if not math.isfinite(value):
        return None
    return int(value) if whole else value
