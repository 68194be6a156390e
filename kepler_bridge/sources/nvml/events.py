"""XID critical errors: a thread waits for NVML's events and counts them per GPU for the sampler."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import NamedTuple, Sequence

import pynvml

log = logging.getLogger(__name__)

EVENT_WAIT_MS = 1000
MAX_XID_CODES = 64  # distinct xid label values per GPU, besides "other"

XidCounts = tuple[tuple[int | str, int], ...]  # (code or "other", count), codes in order


class XidState(NamedTuple):
    """What the counter knows of one device: counts per code, and the time (wall clock) and code
    of the last XID (None before any)."""

    counts: XidCounts
    last_seen: float | None
    last_code: int | None


class XidCounter:
    """XID events counted per device by the event thread, read by the sampler.

    The MAX_XID_CODES codes seen most recently are counted each; an older one's count moves to
    "other", which only grows, so a driver reporting ever new codes cannot grow the series without
    bound.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[int, dict[int, int]] = {}  # in order of last occurrence, most recent last
        self.other: dict[int, int] = {}
        self.last: dict[int, float] = {}

    def add(self, index: int, xid: int) -> None:
        with self.lock:
            per_device = self.counts.setdefault(index, {})
            per_device[xid] = per_device.pop(xid, 0) + 1
            if len(per_device) > MAX_XID_CODES:
                oldest = next(iter(per_device))
                self.other[index] = self.other.get(index, 0) + per_device.pop(oldest)
            self.last[index] = time.time()

    def of(self, index: int) -> XidState:
        """One device's counts, and the wall-clock time and code of its last XID."""
        with self.lock:
            per_device = self.counts.get(index, {})
            counts: list[tuple[int | str, int]] = sorted(per_device.items())
            if index in self.other:
                counts.append(("other", self.other[index]))
            return XidState(tuple(counts), self.last.get(index), next(reversed(per_device), None))


class XidEvents:
    """The event thread of the nvml source and the counts it keeps (kept across restarts)."""

    def __init__(self) -> None:
        self.counter = XidCounter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, indexes: Sequence[int]) -> None:
        """Watch the GPUs of these NVML indexes, in thread kepler-bridge-nvml-events."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch,
            args=(tuple(indexes),),
            name="kepler-bridge-nvml-events",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end at its next wake-up (within EVENT_WAIT_MS); `join` waits."""
        self._stop.set()

    def join(self) -> None:
        """Wait for the thread about two event waits; before nvmlShutdown."""
        if self._thread is not None:
            self._thread.join(EVENT_WAIT_MS / 1000 * 2)

    def _watch(self, indexes: tuple[int, ...]) -> None:
        """Event thread: blocks in nvmlEventSetWait and counts XID critical errors per GPU."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.info("XID events unavailable: %s", err)
            return
        try:
            by_handle = _register(event_set, indexes)
            while by_handle and not self._stop.is_set():
                self._wait(event_set, by_handle)
        finally:
            pynvml.nvmlEventSetFree(event_set)

    def _wait(self, event_set: object, by_handle: dict[int | None, int]) -> None:
        """Wait for one event (or EVENT_WAIT_MS) and count it if it is an XID of a watched GPU."""
        try:
            data = pynvml.nvmlEventSetWait(event_set, EVENT_WAIT_MS)
        except pynvml.NVMLError_Timeout:
            return
        except pynvml.NVMLError as err:
            log.debug("nvmlEventSetWait: %s", err)
            self._stop.wait(1.0)
            return
        index = by_handle.get(ctypes.cast(data.device, ctypes.c_void_p).value)
        if index is not None and data.eventType == pynvml.nvmlEventTypeXidCriticalError:
            self.counter.add(index, int(data.eventData))


def _register(event_set: object, indexes: tuple[int, ...]) -> dict[int | None, int]:
    """Register the GPUs for XID events: handle address -> NVML index of each that could be."""
    by_handle: dict[int | None, int] = {}
    for index in indexes:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
            by_handle[ctypes.cast(handle, ctypes.c_void_p).value] = index
        except pynvml.NVMLError as err:
            log.info("GPU %d: XID events unavailable: %s", index, err)
    return by_handle
