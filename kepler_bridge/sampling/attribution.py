"""Kepler-style energy attribution: node energy to processes, containers and pods, as counters.

Pure (no I/O, no clock): the sampler calls ``Attribution.update`` once per
sample with the sources' readings. Three calculations make one interval:
cpu_energy.py gives the node's active CPU energy and shares it by CPU time,
gpu_energy.py splits each GPU's energy into idle and active and shares the
active part over its processes or holders, and ledger.py adds the shares to
the process, container and pod counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Mapping

from kepler_bridge.model import (
    NO_POD,
    CpuTimes,
    Energy,
    GpuReading,
    PodRef,
    ProcessLabels,
    RaplZone,
    process_labels,
)
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.cpu_energy import CpuEnergy, share_cpu
from kepler_bridge.sampling.gpu_energy import GpuEnergy
from kepler_bridge.sampling.ledger import Joules, Ledger
from kepler_bridge.turns import TURNS


@dataclass(frozen=True)
class SampleInputs:
    """One sample's readings as the sampler gathered them, with the Kubernetes owners it joined."""

    now: float  # monotonic seconds
    rapl_zones: tuple[RaplZone, ...] = ()
    cpu_times: CpuTimes | None = None
    gpus: tuple[
        GpuReading, ...
    ] = ()  # node-wide, counters already monotonic, holders and process owners set
    cpu_increases: Mapping[ProcessLabels, float] = field(default_factory=dict)
    owners: Mapping[ProcessLabels, PodRef] = field(
        default_factory=dict
    )  # of cpu_increases' processes; NO_POD if absent


class Attribution:
    """Keeps the previous sample's counters and the accumulated joules of every level."""

    def __init__(
        self,
        *,
        cpu_tdp_watts: float = 0.0,
        gpu_idle_watts: float | None = None,
        process_limit: int | None = 50,
        grace: float = 30.0,
        max_processes: int = 0,
    ) -> None:
        self._cpu = CpuEnergy(cpu_tdp_watts)
        self._gpu = GpuEnergy(gpu_idle_watts)
        self._ledger = Ledger(process_limit=process_limit, grace=grace, max_processes=max_processes)
        self._last_now: float | None = None

    def configure(
        self,
        *,
        cpu_tdp_watts: float,
        gpu_idle_watts: float | None,
        process_limit: int | None,
        grace: float,
        max_processes: int,
    ) -> None:
        """Set the settings; called again on reload, when the accumulated joules stay."""
        self._cpu.configure(cpu_tdp_watts)
        self._gpu.configure(gpu_idle_watts)
        self._ledger.configure(
            process_limit=process_limit, grace=grace, max_processes=max_processes
        )

    def forget(self, uuids: set[str]) -> None:
        """Drop the energy kept of devices gone for good."""
        self._gpu.forget(uuids)

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`; `restore` takes it back."""
        return {
            "last_now": self._last_now,
            "cpu": self._cpu.state(),
            "gpu": self._gpu.state(),
            "ledger": self._ledger.state(),
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        self._last_now = carry.optional_number(carry.field(state, "last_now"))
        self._cpu.restore(carry.field(state, "cpu"))
        self._gpu.restore(carry.field(state, "gpu"))
        self._ledger.restore(carry.field(state, "ledger"))

    def update(self, inputs: SampleInputs) -> Energy:
        """Attribute the interval since the previous call and return every counter."""
        now = inputs.now
        seconds = now - self._last_now if self._last_now is not None else 0.0
        self._last_now = now
        TURNS.give_way()
        active, capacity = self._cpu.active(inputs.rapl_zones, inputs.cpu_times, seconds)
        increments = {
            key: Joules(cpu=joules)
            for key, joules in share_cpu(active, inputs.cpu_increases, capacity).items()
        }
        TURNS.give_way()
        gpu_joules, owned = self._gpu.share(inputs.gpus, seconds)
        for key, joules in gpu_joules.items():
            if not joules:  # an idle device's processes: the ledger books only what was gained
                continue
            found = increments.get(key)
            if found is None:
                increments[key] = Joules(gpu=joules)
            else:
                found.gpu += joules
        TURNS.give_way()
        self._ledger.add(owners(inputs), increments, owned, now)
        TURNS.give_way()
        return Energy(
            cpu_zones=self._cpu.zones(),
            gpu_idle=self._gpu.idle(),
            gpu_unattributed=self._gpu.unattributed(),
            cpu_processes=self._ledger.process_rows(increments, "cpu"),
            gpu_processes=self._ledger.process_rows(increments, "gpu"),
            containers=self._ledger.containers(),
            pods=self._ledger.pods(),
        )


def owners(inputs: SampleInputs) -> dict[ProcessLabels, PodRef]:
    """The owner of every process of the sample; a GPU process's own owner wins over none."""
    increases, given = inputs.cpu_increases, inputs.owners
    if list(given) == list(increases):  # as the sampler gives them: no need to look each up
        found = dict(given)
    else:
        found = dict(zip(increases, map(given.get, increases, repeat(NO_POD))))
    for gpu in inputs.gpus:
        for proc in gpu.processes:
            owner, key = proc.owner, process_labels(proc)
            if (owner is not NO_POD and owner != NO_POD) or key not in found:
                found[key] = owner
    return found
