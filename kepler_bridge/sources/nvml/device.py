"""What the nvml source remembers about one GPU between samples, and how it asks NVML a value."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pynvml

from kepler_bridge.model import GpuProcess
from kepler_bridge.sources.base import Retry
from kepler_bridge.sources.nvml.gpm import Gpm

MAX_DEVICE_BACKOFF_SECONDS = 30.0
# A value NVML cannot report is asked again after --nvml-reprobe-interval, doubling each time it
# still cannot, up to this many times the interval.
MAX_REPROBE_FACTOR = 10

# NVML answers meaning "this device cannot report this field": remembered, asked again rarely.
UNSUPPORTED = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_INVALID_ARGUMENT,
)


# (name, NVML function, output type, arguments after the handle) of getters of one number.
Getters = tuple[tuple[str, str, type, tuple[int, ...]], ...]


class Outputs(ctypes.Structure):
    """The outputs of a getter that fills several, each given its own pointer, in the order of
    the fields; the first is named `value`."""


def _pointers(output: Any) -> tuple[Any, ...]:
    """The pointer arguments a getter fills `output` through."""
    if isinstance(output, Outputs):
        offsets = (getattr(type(output), field[0]).offset for field in output._fields_)
        return tuple(ctypes.byref(output, offset) for offset in offsets)
    return (ctypes.byref(output),)


def decoded(value: bytes | str) -> str:
    """An NVML string (bytes in older bindings) as str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def text(getter: Callable[..., Any], *args: Any) -> str:
    """What a pynvml string getter answers, as str, its bytes that are not UTF-8 replaced: the
    binding's own wrapper decodes strictly, and one GPU with a garbled name would fail the read
    of every GPU."""
    return decoded(getattr(getter, "__wrapped__", getter)(*args))


@dataclass
class Device:
    """One GPU by its NVML index: its handle and identity once acquired, and its health."""

    index: int
    handle: Any = None
    uuid: str = ""
    model: str = ""
    pci_bus_id: str = ""
    blank: dict[str, Any] = field(default_factory=dict)  # its GpuReading fields before a read
    unsupported: dict[str, Retry] = field(default_factory=dict)  # name -> when to ask again
    answered: set[str] = field(default_factory=set)  # the names NVML gave a value this sample
    now: float = 0.0  # the sample's monotonic time
    reprobe: float = 0.0  # --nvml-reprobe-interval, set by begin()
    error: str = ""
    retry: Retry = field(default_factory=lambda: Retry(MAX_DEVICE_BACKOFF_SECONDS))
    last_process_sample_us: int = 0
    comms: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (comm, container id)
    process_rows: dict[int, GpuProcess] = field(default_factory=dict)  # the last read's, by pid
    # What those rows were made of: used memory and SM utilization by pid (processes.py).
    process_inputs: tuple[dict[int, int | None], dict[int, float] | None] | None = None
    gpm: Gpm = field(default_factory=Gpm)
    mig_profiles: dict[int, Any] | None = None  # mig.py's GPU instance profiles, asked once
    mig_enabled: bool = False  # mig.py's MIG mode as last asked
    # Used memory by pid over the MIG devices' own process lists, as mig.py last read them.
    mig_processes: dict[int, int | None] = field(default_factory=dict)
    lists: dict[str, Any] = field(default_factory=dict)  # processes.py's list calls, by name
    # reliability.py's slow counters (GpuReading fields) as last read, and when; links.py's
    # error counters of each link that was up.
    counters: dict[str, Any] | None = None
    counters_at: float = 0.0
    counters_due: bool = True  # set by begin(): read the slow counters in this sample
    link_errors: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # numbers()'s and record()'s NVML getters by name: the function, its arguments after the handle
    # and its output.
    getters: dict[str, tuple[Any, tuple[Any, ...], Any]] = field(default_factory=dict)

    def fail(self, message: str, interval: float, now: float) -> None:
        self.handle, self.error = None, message
        self.gpm.close()
        self.counters, self.mig_enabled = None, False
        self.link_errors.clear()
        self.retry.failed(interval, now)

    def begin(self, now: float, reprobe: float, counter_period: float) -> None:
        """A new sample at `now`; values not supported are asked again after `reprobe` s, the
        slow counters read again once `counter_period` s passed since their last read."""
        self.now, self.reprobe = now, reprobe
        self.counters_due = self.counters is None or now >= self.counters_at + counter_period
        if self.counters_due:
            self.counters_at = now
        self.answered.clear()

    def query(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        """One NVML call, `call(*args)`; None when the device cannot report it (remembered, and
        asked again when its re-probe is due). Other errors raise."""
        retry = self.unsupported.get(name)
        if retry is not None and not retry.due(self.now):
            return None
        try:
            value = call(*args)
        except pynvml.NVMLError as err:
            if err.value in UNSUPPORTED:
                self.cannot(name)
                return None
            raise
        if retry is not None:
            del self.unsupported[name]
        self.answered.add(name)
        return value

    def numbers(self, getters: Getters) -> list[Any]:
        """The number of each NVML getter of one number, `function(handle, *args, &number)`, in
        one loop: None where the device cannot report it (as `query`). Called without pynvml's
        wrapper (about half the cost of a call), the function looked up once, its output kept."""
        found: list[Any] = []
        for name, function, kind, args in getters:
            retry = self.unsupported.get(name)
            if retry is not None and not retry.due(self.now):
                found.append(None)
                continue
            try:
                output = self._fill(name, function, kind, args)
            except pynvml.NVMLError as err:
                if err.value not in UNSUPPORTED:
                    raise
                self.cannot(name)
                found.append(None)
                continue
            if retry is not None:
                del self.unsupported[name]
            self.answered.add(name)
            found.append(output.value)
        return found

    def record(self, name: str, function: str, make: Callable[[], Any], *args: int) -> Any:
        """`query` of an NVML getter that fills a structure, `make()` made once, called as
        `numbers` calls: the very structure at every call, to be read before the next."""
        return self.query(name, self._fill, name, function, make, args)

    def _fill(self, name: str, function: str, make: Callable[[], Any], args: tuple) -> Any:
        """Call the getter kept under `name` (looked up and its output made at the first call:
        FunctionNotFound on an older driver) and return its output; NVMLError on an error."""
        getter = self.getters.get(name)
        if getter is None:
            call, output = pynvml._nvmlGetFunctionPointer(function), make()
            getter = self.getters[name] = (call, (*args, *_pointers(output)), output)
        call, arguments, output = getter
        result = call(self.handle, *arguments)
        if result != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(result)
        return output

    def profiling(self) -> dict[str, Any]:
        """This interval's GPM fields; what GPM said it cannot do is asked again when due."""
        self.gpm.reprobe(self.handle, self.now, self.reprobe, MAX_REPROBE_FACTOR * self.reprobe)
        return self.gpm.read(self.handle, self.index)

    def cannot(self, name: str) -> None:
        """NVML cannot report `name` now: not asked again until its re-probe is due."""
        self.answered.discard(name)
        retry = self.unsupported.setdefault(name, Retry(0.0))
        retry.cap = MAX_REPROBE_FACTOR * self.reprobe
        retry.failed(self.reprobe, self.now)


def unsupported_summary(devices: Iterable[Device], measured: Callable[[int], Iterable[str]]) -> str:
    """For `doctor`: what each GPU cannot report (NVML says not supported), so its series are
    absent; GPUs that lack the same values are named together. `measured`: what a GPU cannot
    report among the values measured outside its samples (PCIe throughput)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for device in devices:
        names = tuple(sorted({*device.unsupported, *measured(device.index)}))
        if names:
            groups.setdefault(names, []).append(str(device.index))
    return "".join(
        f"; GPU {', '.join(ids)} cannot report {', '.join(names)} (not supported: absent)"
        for names, ids in groups.items()
    )
