"""The configured sources, each in a slot that keeps its health: start, retry, read, fallback.

A source's failed start() is described by `start_error` alone, whether at start-up, on a retry or
in `doctor`; every reading passes `read_clean` on its way in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterable, Mapping, TypeVar

from kepler_bridge.config import Config
from kepler_bridge.log_limit import EveryInterval
from kepler_bridge.model import SourceReading, SourceStatus, replaced
from kepler_bridge.printable import printable
from kepler_bridge.sampling import sanitize
from kepler_bridge.sources import make_source, selected_groups
from kepler_bridge.sources.base import Retry, Source, SourceAbsent, SourceUnavailable
from kepler_bridge.turns import TURNS

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0
T = TypeVar("T")


def start_error(err: Exception) -> str:
    """What a failed start() says: the source's own reason, or for an unexpected exception (a
    broken driver) its type and message."""
    if isinstance(err, (SourceAbsent, SourceUnavailable)):
        return printable(str(err)) or type(err).__name__
    return f"{type(err).__name__}: {printable(str(err))}" if str(err) else type(err).__name__


def read_clean(source: Source) -> SourceReading:
    """One read, sanitised: the only way readings enter a snapshot or `doctor`."""
    reading = source.read()
    TURNS.give_way()
    return sanitize.reading(reading)


@dataclass
class Slot:
    """One configured source and its health."""

    name: str
    source: Source | None  # None: a standby or absent alternative, never started again
    started: bool = False
    error: str = ""
    errors_total: int = 0
    retry: Retry = field(default_factory=lambda: Retry(MAX_BACKOFF_SECONDS))
    not_in_use: str = ""  # SourceStatus.not_in_use: "absent" or "standby"
    last: SourceReading = field(default_factory=SourceReading)
    # A source whose error text changes every sample (a timestamp in it) must not flood the log.
    failure_line: EveryInterval = field(
        default_factory=lambda: EveryInterval(log, "source %s failed: %s")
    )

    def fail(self, message: str, interval: float, now: float) -> None:
        self.error, self.not_in_use = message, ""
        self.errors_total += 1
        self.retry.failed(interval, now)

    def absent(self, message: str, interval: float, now: float) -> None:
        """No such hardware here, which is no failure; tried again later, as a driver may load or
        a device appear."""
        self.error, self.not_in_use = message, "absent"
        self.retry.failed(interval, now)

    def start(self, interval: float, now: float) -> None:
        """Start the source; a failure is recorded and the next try put off."""
        assert self.source is not None
        try:
            self.source.start()
        except Exception as err:  # a broken driver must not stop the agent
            if isinstance(err, SourceAbsent):
                self.absent(start_error(err), interval, now)
            else:
                self.fail(start_error(err), interval, now)
            return
        self.started, self.error, self.not_in_use = True, "", ""
        self.retry.succeeded()

    def read(self, interval: float, now: float) -> SourceReading:
        """This sample's reading; a source not started yet is started when its retry is due, and
        a failing one gives its last reading (its devices down). A new reason for failing is
        logged, and so is the recovery."""
        before = self.error
        reading = self._read(interval, now)
        if self.error and self.error != before and not self.not_in_use:
            self.failure_line.warning(self.name, self.error)
        elif before and not self.error:
            log.info("source %s is up", self.name)
        return reading

    def _read(self, interval: float, now: float) -> SourceReading:
        if self.source is None:
            return SourceReading()
        if not self.started:
            if self.retry.due(now):
                self.start(interval, now)
            if not self.started:
                return self.last
        try:
            reading = read_clean(self.source)
        except Exception as err:
            log.debug("source %s failed", self.name, exc_info=True)
            self.error = printable(str(err)) or type(err).__name__
            self.errors_total += 1
            return replaced(
                self.last,
                gpus=tuple(replaced(gpu, up=False, error=self.error) for gpu in self.last.gpus),
            )
        self.error = ""
        self.last = reading
        return reading

    def configure(self, config: Config) -> None:
        """Hand reloaded settings to the source."""
        if self.source is not None:
            self.source.configure(config)

    def stop(self) -> None:
        """Release the source if it started."""
        if self.source is not None and self.started:
            try:
                self.source.stop()
            except Exception as err:
                log.warning("stopping source %s: %s", self.name, err)

    def status(self) -> SourceStatus:
        up = self.started and not self.error
        return SourceStatus(self.name, up, self.error, self.errors_total, self.not_in_use)


def open_slot(name: str, config: Config) -> Slot:
    """A slot with the named source made and started (or its failure recorded)."""
    slot = Slot(name, make_source(name, config))
    slot.start(config.interval, time.monotonic())
    return slot


def build_slots(config: Config) -> list[Slot]:
    """Start the configured sources; within a group the first that starts is used and those
    before it stand by."""
    slots: list[Slot] = []
    for group in selected_groups(config):
        for position, name in enumerate(group):
            slot = open_slot(name, config)
            if slot.started or position == len(group) - 1:
                if slot.not_in_use:
                    log.info("source %s is absent: %s", name, slot.error)
                elif slot.error:
                    log.warning("source %s failed: %s", name, slot.error)
                slots.append(slot)
                break
            # An alternative that lost to the next one is never retried: both would count the
            # same CPU time.
            log.warning(
                "source %s is unavailable, %s takes its place: %s",
                name,
                group[position + 1],
                slot.error,
            )
            slots.append(
                Slot(
                    name,
                    None,
                    error=slot.error,
                    errors_total=slot.errors_total,
                    not_in_use=slot.not_in_use or "standby",
                )
            )
    return slots


def read_all(slots: list[Slot], interval: float, now: float) -> SourceReading:
    """Every slot read once, as one reading: the devices, processes and zones of all, the last
    CPU times given, and the eBPF programs attached summed (None when no source has any)."""
    readings = []
    for slot in slots:
        TURNS.give_way()
        readings.append(slot.read(interval, now))
    TURNS.give_way()
    attached = [r.ebpf_programs_attached for r in readings if r.ebpf_programs_attached is not None]
    cpu_times = [r.cpu_times for r in readings if r.cpu_times is not None]
    return SourceReading(
        gpus=_joined(reading.gpus for reading in readings),
        processes=_joined(reading.processes for reading in readings),
        ebpf_programs_attached=sum(attached) if attached else None,
        rapl_zones=_joined(reading.rapl_zones for reading in readings),
        cpu_times=cpu_times[-1] if cpu_times else None,
    )


def _joined(parts: Iterable[tuple[T, ...]]) -> tuple[T, ...]:
    """The rows of every reading, in C: thousands of processes a sample; the one reading's own
    tuple where only one has any."""
    found = [part for part in parts if part]
    return found[0] if len(found) == 1 else tuple(chain.from_iterable(found))


def check_source(name: str, config: Config) -> tuple[bool, str]:
    """Start and read one source once, for `doctor`: whether it works and one line saying what
    or why not."""
    source = make_source(name, config)
    try:
        source.start()
    except Exception as err:
        return False, start_error(err)
    try:
        return True, source.describe(read_clean(source))
    except Exception as err:
        return False, f"started, but reading failed: {printable(str(err))}"
    finally:
        source.stop()


def replace_command(slots: list[Slot], config: Config, retired: dict[str, int]) -> list[Slot]:
    """The slots with the command source stopped and, where --command is still set, started again
    with the new one.

    Its errors so far go to `retired` and a new command slot counts on from there, so
    source_errors_total never decreases; while --command is unset they wait in `retired`."""
    kept = [slot for slot in slots if slot.name != "command"]
    for slot in slots:
        if slot.name == "command":
            slot.stop()
            retired["command"] = retired.get("command", 0) + slot.errors_total
    if ("command",) in selected_groups(config):
        command = open_slot("command", config)
        command.errors_total += retired.pop("command", 0)
        kept.append(command)
    return kept


def carry_errors(slots: list[Slot], errors: Mapping[str, int]) -> dict[str, int]:
    """Add each source's errors counted by a previous worker to its slot; return those of sources
    with no slot now, which wait for one."""
    waiting = dict(errors)
    for slot in slots:
        slot.errors_total += waiting.pop(slot.name, 0)
    return waiting
