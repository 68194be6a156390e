"""Node-wide `gpu` indexes that stay with a device for the agent's life, and when it is gone.

A device keeps its index whatever order the sources list devices in, and an
index is never reused; one down at its first sight (no uuid yet, known by
its place in its source's list) keeps that index once its uuid comes. One
absent from the readings for `--device-grace` is forgotten: the sampler
drops its counters too, and if it comes back it starts again like a new
device. At most MAX_ABSENT absent devices are remembered, the longest
absent forgotten first, so a source inventing uuids costs bounded memory.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from kepler_bridge.model import MAX_DEVICES, GpuReading, replaced
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import integer, number, text

MAX_ABSENT = MAX_DEVICES
log = logging.getLogger(__name__)

Identity = tuple[str, str]  # vendor, uuid


class DeviceIndexes:
    """Gives each device (vendor, uuid) the next unused index when first seen, and keeps it."""

    def __init__(self) -> None:
        self._known: dict[Identity, int] = {}
        self._seen: dict[Identity, float] = {}  # monotonic time of the last sample listing it
        self._next = 0
        self._twice: set[str] = set()  # uuids found listed twice, told once

    def number(self, gpus: Iterable[GpuReading], now: float) -> tuple[GpuReading, ...]:
        """The readings with their node-wide index, in index order.

        A device listed twice is kept once (the first): a uuid names one chip whichever source or
        vendor lists it, and its counters are kept by uuid. A device without a uuid (down before
        its source could ask it) is told apart by its vendor and place in its source's list."""
        numbered: dict[Identity, GpuReading] = {}
        listed: set[str | Identity] = set()
        for gpu in gpus:
            identity = (gpu.vendor, gpu.uuid or f"#{gpu.index}")
            chip = gpu.uuid or identity
            if chip in listed:
                self._listed_twice(gpu)
                continue
            listed.add(chip)
            if identity not in self._known:
                self._take_index(identity, (gpu.vendor, f"#{gpu.index}"), numbered)
            self._seen[identity] = now
            numbered[identity] = replaced(gpu, index=self._known[identity])
        return tuple(sorted(numbered.values(), key=lambda gpu: gpu.index))

    def _listed_twice(self, gpu: GpuReading) -> None:
        """Say once per uuid that a second device with it is left out: the same chip through two
        sources, or two chips a broken board or VM gives one uuid."""
        if gpu.uuid not in self._twice and len(self._twice) < MAX_DEVICES:
            self._twice.add(gpu.uuid)
            log.warning(
                "device uuid %s is listed twice (again by %s as device %d, pci %s): only the first "
                "is read; if they are two chips, their board or VM gives them one uuid",
                gpu.uuid,
                gpu.vendor,
                gpu.index,
                gpu.pci_bus_id or "unknown",
            )

    def _take_index(
        self, identity: Identity, placeholder: Identity, numbered: dict[Identity, GpuReading]
    ) -> None:
        """Give a device seen for the first time an index: the one it had while down at its
        first sight (known by its place, not yet by its uuid), so its series keep their `gpu`
        label, else the next unused."""
        if identity[1] != placeholder[1] and placeholder in self._known:
            if placeholder not in numbered:  # not another device down in that place now
                self._known[identity] = self._known.pop(placeholder)
                del self._seen[placeholder]
                return
        self._known[identity], self._next = self._next, self._next + 1

    def expire(self, now: float, grace: float) -> set[str]:
        """Forget the devices absent for more than `grace` seconds, and the longest absent beyond
        MAX_ABSENT; the uuids no remembered device has any more."""
        absent = sorted((seen, identity) for identity, seen in self._seen.items() if seen < now)
        gone = [
            identity
            for position, (seen, identity) in enumerate(absent)
            if now - seen > grace or position < len(absent) - MAX_ABSENT
        ]
        for identity in gone:
            del self._known[identity], self._seen[identity]
        return {uuid for _, uuid in gone} - {uuid for _, uuid in self._known}

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`: the next index and [vendor, uuid, index, last seen] per
        device."""
        return {
            "next": self._next,
            "devices": [
                [vendor, uuid, index, self._seen[(vendor, uuid)]]
                for (vendor, uuid), index in self._known.items()
            ],
        }

    def restore(self, state: object) -> None:
        """Take the devices a previous worker saved; raises carry.BadState on a wrong value."""
        found = carry.rows(carry.field(state, "devices"), text, text, integer, number)
        self._next = integer(carry.field(state, "next"))
        self._known = {(vendor, uuid): index for vendor, uuid, index, _ in found}
        self._seen = {(vendor, uuid): seen for vendor, uuid, _, seen in found}
        indexes = set(self._known.values())
        if len(indexes) != len(self._known) or any(not 0 <= i < self._next for i in indexes):
            raise carry.BadState("device indexes that this agent does not give")
