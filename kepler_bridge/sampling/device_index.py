"""Node-wide `gpu` indexes that stay with a device for the agent's life.

A device keeps its index whatever order the sources list devices in.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from kepler_bridge.model import GpuReading

# Identities remembered at most; beyond it (a command inventing uuids)
# the ones absent from the sample are forgotten.
MAX_KNOWN = 4096


class DeviceIndexes:
    """Gives each device (vendor, uuid) the next unused index when first seen, and keeps it."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], int] = {}
        self._next = 0

    def number(self, gpus: Iterable[GpuReading]) -> tuple[GpuReading, ...]:
        """The readings with their node-wide index, in index order.

        A device listed twice is kept once (the first)."""
        numbered: dict[tuple[str, str], GpuReading] = {}
        for gpu in gpus:
            identity = (gpu.vendor, gpu.uuid)
            if (
                identity in numbered
            ):  # two sources reading one chip: its series would be exported twice
                continue
            if identity not in self._known:
                self._known[identity], self._next = self._next, self._next + 1
            numbered[identity] = dataclasses.replace(gpu, index=self._known[identity])
        if len(self._known) > MAX_KNOWN:
            self._known = {identity: gpu.index for identity, gpu in numbered.items()}
        return tuple(sorted(numbered.values(), key=lambda gpu: gpu.index))
