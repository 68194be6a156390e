"""What the nvml source remembers about one GPU between samples, and how it asks NVML a value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pynvml

from kepler_bridge.sources.base import Retry
from kepler_bridge.sources.nvml.gpm import Gpm

MAX_DEVICE_BACKOFF_SECONDS = 30.0

# NVML answers meaning "this device cannot report this field": remembered, never asked again.
UNSUPPORTED = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_INVALID_ARGUMENT,
)


def decoded(value: bytes | str) -> str:
    """An NVML string (bytes in older bindings) as str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass
class Device:
    """One GPU by its NVML index: its handle and identity once acquired, and its health."""

    index: int
    handle: Any = None
    uuid: str = ""
    model: str = ""
    pci_bus_id: str = ""
    unsupported: set[str] = field(default_factory=set)
    error: str = ""
    retry: Retry = field(default_factory=lambda: Retry(MAX_DEVICE_BACKOFF_SECONDS))
    last_process_sample_us: int = 0
    comms: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (comm, container id)
    gpm: Gpm = field(default_factory=Gpm)
    mig_profiles: dict[int, Any] | None = None  # mig.py's GPU instance profiles, asked once

    def fail(self, message: str, interval: float, now: float) -> None:
        self.handle, self.error = None, message
        self.gpm.close()
        self.retry.failed(interval, now)

    def query(self, name: str, call: Callable[[], Any]) -> Any:
        """One NVML call; None when the device cannot report it (remembered). Other errors raise."""
        if name in self.unsupported:
            return None
        try:
            return call()
        except pynvml.NVMLError as err:
            if err.value in UNSUPPORTED:
                self.unsupported.add(name)
                return None
            raise


def unsupported_summary(devices: Iterable[Device]) -> str:
    """For `doctor`: what each GPU cannot report (NVML says not supported), so its series are
    absent; GPUs that lack the same values are named together."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for device in devices:
        if device.unsupported:
            groups.setdefault(tuple(sorted(device.unsupported)), []).append(str(device.index))
    return "".join(
        f"; GPU {', '.join(ids)} cannot report {', '.join(names)} (not supported: absent)"
        for names, ids in groups.items()
    )
