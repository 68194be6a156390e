"""A fake `nvidia-smi` that answers `--query-gpu` from the fake NVML's config (tests/fakenvml).

It knows the fields of `--help-query-gpu` below, prints `[N/A]` for a field whose config key is
in the GPU's `not_supported`, and fails like nvidia-smi without a driver when FAKE_NVML_CONFIG
is unset. FAKE_SMI_OVERRIDE="field=value,..." makes it print other values than the fake NVML
has, to test a disagreement. `--query-remapped-rows` answers only where FAKE_SMI_REMAPPED_ROWS
gives the four values (correctable, uncorrectable, pending, failure) for every GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

MIB = 2**20
# nvidia-smi field -> (config key of gpu.N, how the value is printed).
FIELDS: dict[str, tuple[str, Callable[[str], str]]] = {
    "uuid": ("uuid", str),
    "name": ("name", str),
    "pci.bus_id": ("pci_bus_id", str),
    "utilization.gpu": ("utilization_gpu", str),
    "utilization.memory": ("utilization_memory", str),
    "utilization.encoder": ("encoder_utilization", str),
    "utilization.decoder": ("decoder_utilization", str),
    "memory.used": ("memory_used", lambda value: str(int(value) // MIB)),
    "memory.total": ("memory_total", lambda value: str(int(value) // MIB)),
    "memory.free": ("memory_free", lambda value: str(int(value) // MIB)),
    "temperature.gpu": ("temperature", str),
    "temperature.memory": ("memory_temperature", str),
    "power.draw": ("power_usage", lambda value: f"{int(value) / 1000:.2f}"),
    "enforced.power.limit": ("power_limit", lambda value: f"{int(value) / 1000:.2f}"),
    "clocks.sm": ("clock_sm", str),
    "clocks.mem": ("clock_memory", str),
    "fan.speed": ("fan_speed", str),
    "pstate": ("performance_state", lambda value: f"P{value}"),
    "clocks_event_reasons.active": ("clocks_event_reasons", lambda value: f"0x{int(value):016x}"),
    "ecc.errors.corrected.volatile.total": ("ecc_corrected_volatile", str),
    "ecc.errors.uncorrected.volatile.total": ("ecc_uncorrected_volatile", str),
}
GROUPS = {
    "utilization": ("utilization_gpu", "utilization_memory"),
    "memory": ("memory_used", "memory_total", "memory_free"),
    "clocks": ("clock_sm", "clock_memory"),
    "ecc": ("ecc_corrected_volatile", "ecc_uncorrected_volatile"),
}
CONSTANT = {"pcie.link.gen.current": "4", "pcie.link.width.current": "16"}


def config() -> dict[str, str]:
    path = os.environ.get("FAKE_NVML_CONFIG")
    if not path or not Path(path).is_file():
        print(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running."
        )
        raise SystemExit(9)
    lines = Path(path).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def value(values: dict[str, str], index: int, name: str) -> str:
    """One field of GPU `index` as nvidia-smi prints it with `nounits`."""
    if name == "index":
        return str(index)
    if name == "driver_version":
        return values["driver_version"]
    if name in CONSTANT:
        return CONSTANT[name]
    key, form = FIELDS[name]
    unsupported = set(values.get(f"gpu.{index}.not_supported", "").split(","))
    for group in unsupported & set(GROUPS):
        unsupported |= set(GROUPS[group])
    if key in unsupported or f"gpu.{index}.{key}" not in values:
        return "[N/A]"
    return form(values[f"gpu.{index}.{key}"])


def query(names: list[str]) -> None:
    values = config()
    count = int(values.get("device_count", "0"))
    if count == 0:
        print("No devices were found")
        raise SystemExit(6)
    override = dict(
        item.split("=", 1) for item in os.environ.get("FAKE_SMI_OVERRIDE", "").split(",") if item
    )
    for index in range(count):
        if values.get(f"gpu.{index}.lost") == "1":
            continue
        print(", ".join(override.get(name) or value(values, index, name) for name in names))


def main(args: list[str]) -> int:
    known = ["index", "driver_version", *FIELDS, *CONSTANT]
    if args == ["--help-query-gpu"]:
        print('List of valid properties to query for the switch "--query-gpu=":\n')
        print("\n\n".join(f'"{name}"\nThe fake value of {name}.' for name in known))
        return 0
    remapped = os.environ.get("FAKE_SMI_REMAPPED_ROWS")
    if remapped and any(arg.startswith("--query-remapped-rows=") for arg in args):
        values = config()
        for index in range(int(values.get("device_count", "0"))):
            print(", ".join([values[f"gpu.{index}.uuid"], *remapped.split(",")]))
        return 0
    queries = [arg.split("=", 1)[1] for arg in args if arg.startswith("--query-gpu=")]
    if not queries:
        print(f"fake nvidia-smi: only --query-gpu and --help-query-gpu, not {args}")
        return 2
    names = queries[0].split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f'Field "{unknown[0]}" is not a valid field to query.')
        return 2
    query(names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
