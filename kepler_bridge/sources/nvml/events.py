"""XID critical errors: the sampler takes NVML's events each sample and counts them per GPU."""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, NamedTuple, Sequence

import pynvml

log = logging.getLogger(__name__)

MAX_EVENTS_PER_SAMPLE = 256  # a driver flooding events cannot hold a sample for ever
MAX_XID_CODES = 64  # distinct xid label values per GPU, besides "other"

XidCounts = tuple[tuple[int | str, int], ...]  # (code or "other", count), codes in order


class XidState(NamedTuple):
    """What the counter knows of one device: counts per code, and the time (wall clock) and code
    of the last XID (None before any)."""

    counts: XidCounts
    last_seen: float | None
    last_code: int | None


class XidCounter:
    """XID events counted per device, both written and read by the sampler.

    The MAX_XID_CODES codes seen most recently are counted each; an older one's count moves to
    "other", which only grows, so a driver reporting ever new codes cannot grow the series without
    bound.
    """

    def __init__(self) -> None:
        self.counts: dict[int, dict[int, int]] = {}  # in order of last occurrence, most recent last
        self.other: dict[int, int] = {}
        self.last: dict[int, float] = {}

    def add(self, index: int, xid: int) -> None:
        per_device = self.counts.setdefault(index, {})
        per_device[xid] = per_device.pop(xid, 0) + 1
        if len(per_device) > MAX_XID_CODES:
            oldest = next(iter(per_device))
            self.other[index] = self.other.get(index, 0) + per_device.pop(oldest)
        self.last[index] = time.time()

    def of(self, index: int) -> XidState:
        """One device's counts, and the wall-clock time and code of its last XID."""
        per_device = self.counts.get(index, {})
        counts: list[tuple[int | str, int]] = sorted(per_device.items())
        if index in self.other:
            counts.append(("other", self.other[index]))
        return XidState(tuple(counts), self.last.get(index), next(reversed(per_device), None))


class XidEvents:
    """The nvml source's XID event set, drained by the sampler each sample without waiting, and the
    counts (kept across restarts). No thread waits on the set: one woken every second to find no
    event costs more CPU than a call per sample that returns at once."""

    def __init__(self) -> None:
        self.counter = XidCounter()
        self._set: object | None = None
        self._by_handle: dict[int | None, int] = {}  # registered in the set: address -> index
        self._handles: dict[int, Any] = {}  # the handle of each GPU up, by index (`renew`)
        # nvmlEventSetWait_v2 called as pynvml would, without its wrapper: no record made and no
        # exception raised per call (it times out at almost every one).
        self._wait: Any = None
        self._data = pynvml.c_nvmlEventData_t()

    def start(self, indexes: Sequence[int]) -> None:
        """Make the event set and register the GPUs of these NVML indexes that have a handle now;
        the others join when acquired (`watch`)."""
        try:
            self._wait = pynvml._nvmlGetFunctionPointer("nvmlEventSetWait_v2")
            self._set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("XID events unavailable: %s", err)
            return
        for index in indexes:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError:
                continue  # down now: registered when acquired
            self.watch(index, handle)

    def watch(self, index: int, handle: Any) -> None:
        """Register the GPU of this NVML index, just acquired, for XID events: once per handle,
        so a GPU that was down at the start, or came back with a new handle, is counted too."""
        if self._set is None:
            return
        self._handles[index] = handle
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if address in self._by_handle:
            return
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._set)
        except pynvml.NVMLError as err:
            log.info("GPU %d: XID events unavailable: %s", index, err)
            return
        self._by_handle[address] = index

    def forget(self, index: int) -> None:
        """The GPU of this NVML index failed: left out of a new set (`renew`) until acquired."""
        self._handles.pop(index, None)

    def stop(self) -> None:
        """Free the event set; before nvmlShutdown."""
        if self._set is not None:
            _free(self._set)
            self._set = None
        self._by_handle.clear()
        self._handles.clear()

    def renew(self) -> None:
        """A new event set of the GPUs up that register now (a lost one does not): NVML answers
        every wait on a set holding a lost GPU GPU_IS_LOST. The events the old one held are lost."""
        handles = list(self._handles.items())
        self.stop()
        try:
            self._set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("XID events unavailable: %s", err)
            return
        for index, handle in handles:
            self.watch(index, handle)

    def drain(self) -> None:
        """Count the XIDs of watched GPUs the driver holds now (at most MAX_EVENTS_PER_SAMPLE: the
        rest wait for the next sample), waiting for none."""
        if not self._by_handle:
            return
        data, wait = self._data, self._wait
        pointer = ctypes.byref(data)
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            result = wait(self._set, pointer, 0)
            if result == pynvml.NVML_ERROR_GPU_IS_LOST:
                log.info("XID events: a GPU is lost; waiting on the others")
                self.renew()  # the next sample waits on the new set
                return
            if result != pynvml.NVML_SUCCESS:
                if result != pynvml.NVML_ERROR_TIMEOUT:
                    log.debug("nvmlEventSetWait: %s", pynvml.NVMLError(result))
                return
            index = self._by_handle.get(ctypes.cast(data.device, ctypes.c_void_p).value)
            if index is not None and data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                self.counter.add(index, int(data.eventData))


def _free(event_set: object) -> None:
    try:
        pynvml.nvmlEventSetFree(event_set)
    except pynvml.NVMLError as err:
        log.debug("nvmlEventSetFree: %s", err)
