"""The interface every source implements."""

from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from kepler_bridge.config import Config
from kepler_bridge.model import GpuReading, SourceReading


class SourceAbsent(Exception):
    """The hardware or kernel feature this source reads does not exist here;
    the message says why."""


class SourceUnavailable(Exception):
    """The source exists but cannot be read now; the message says why and how to fix it."""


@dataclass
class Retry:
    """When to try again something that failed: one interval after the first failure, doubling,
    at most `cap`."""

    cap: float
    delay: float = 0.0
    at: float = 0.0

    def failed(self, interval: float, now: float) -> None:
        """It failed (again): put the next try off."""
        self.delay = min(self.cap, max(interval, self.delay * 2))
        self.at = now + self.delay

    def succeeded(self) -> None:
        """It works: the next failure waits one interval again."""
        self.delay = 0.0

    def due(self, now: float) -> bool:
        """Whether the next try may happen now."""
        return now >= self.at


def device_reading(gpus: tuple[GpuReading, ...], what: str) -> SourceReading:
    """A source's devices as its reading; when every one is down the source is down,
    with the first reason."""
    if gpus and not any(gpu.up for gpu in gpus):
        raise RuntimeError(f"every {what} failed; first error: {gpus[0].error}")
    return SourceReading(gpus=gpus)


class Source(abc.ABC):
    """Reads one kind of hardware or kernel state; never formats output,
    never raises into the sampler loop."""

    name: ClassVar[str]
    # Plug-ins only (built-ins are listed in sources.AUTO): True joins `auto`; start() must then
    # raise SourceAbsent where its hardware does not exist, so it is shown absent there, not down.
    auto: ClassVar[bool] = False

    def __init__(self, config: Config) -> None:
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take the settings in force: at construction and again on each reload
        (drivers stay open)."""
        self.config = config

    @abc.abstractmethod
    def start(self) -> None:
        """Open drivers or load programs; raise SourceAbsent or SourceUnavailable with the
        reason."""

    @abc.abstractmethod
    def read(self) -> SourceReading:
        """Return this sample's readings; any exception marks the source down for this sample."""

    def stop(self) -> None:
        """Release drivers, threads and programs."""

    def describe(self, reading: SourceReading) -> str:
        """One line for `doctor` saying what this source found."""
        parts = []
        if reading.gpus:
            kinds = Counter(" ".join(filter(None, (gpu.vendor, gpu.model))) for gpu in reading.gpus)
            listed = ", ".join(
                kind if count == 1 else f"{count} x {kind}" for kind, count in kinds.items()
            )
            parts.append(f"{len(reading.gpus)} accelerator(s): {listed}")
        if reading.processes:
            parts.append(f"{len(reading.processes)} process(es)")
        return ", ".join(parts) or "works, nothing to report yet"
