"""The joules of every process, container and pod since the agent started; none ever decreases.

Every level only ever adds increases; a workload not seen for the grace
period is forgotten, and processes outside the top:N limit are summed into
one ``pid="other"`` series per kind. Only processes with GPU energy have GPU rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, TypeVar

from kepler_bridge.model import Holder, PodRef, ProcessKey, WorkloadEnergy
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import integer, number, optional_number, text
from kepler_bridge.sampling.top import TopCounter

KINDS = ("cpu", "gpu")  # the fields of Joules, and the `kind` of each per-process family
K = TypeVar("K", bound=Hashable)


@dataclass
class Joules:
    """CPU and GPU joules: one workload's since the start, or one interval's increase."""

    cpu: float = 0.0
    gpu: float = 0.0

    @property
    def total(self) -> float:
        return self.cpu + self.gpu

    def of(self, kind: str) -> float:
        """The joules of one kind, "cpu" or "gpu"."""
        return self.cpu if kind == "cpu" else self.gpu


@dataclass
class Tally:
    """The joules of one process, container or pod, and when it was last present."""

    labels: WorkloadEnergy
    seen: float
    joules: Joules = field(default_factory=Joules)

    def row(self) -> WorkloadEnergy:
        return dataclasses.replace(
            self.labels, cpu_joules=self.joules.cpu, gpu_joules=self.joules.gpu
        )


class Ledger:
    """Accumulated joules per process, container and pod; the top-N families of the process rows."""

    def __init__(self, *, process_limit: int | None, grace: float, max_processes: int) -> None:
        self._families: dict[str, TopCounter[WorkloadEnergy]] = {
            kind: TopCounter(process_limit) for kind in KINDS
        }
        self.configure(process_limit=process_limit, grace=grace, max_processes=max_processes)
        self._processes: dict[ProcessKey, Tally] = {}
        self._containers: dict[
            tuple[str, str, str, str], Tally
        ] = {}  # container id, namespace, pod, container
        self._pods: dict[tuple[str, str], Tally] = {}  # namespace, pod

    def configure(self, *, process_limit: int | None, grace: float, max_processes: int) -> None:
        """Set the settings; called again on reload, when the accumulated joules stay."""
        self.grace = grace
        self.max_processes = max_processes
        for family in self._families.values():
            family.limit = process_limit

    def add(
        self,
        owners: Mapping[ProcessKey, PodRef],
        increments: Mapping[ProcessKey, Joules],
        owned: Mapping[Holder, float],
        now: float,
    ) -> None:
        """Book one interval's increments on processes, their containers and pods, and the holders.

        Then forget what has been gone for the grace period.
        """
        self._accumulate(owners, increments, now)
        self._accumulate_owned(owned, now)
        self._expire(now, owners)

    def process_rows(
        self, increments: Mapping[ProcessKey, Joules], kind: str
    ) -> tuple[WorkloadEnergy, ...]:
        """One kind's per-process rows: the top N by its joules, and pid="other" once one is out.

        A shown series counts from the sample its process entered the top N
        (what it used before went to "other"), so the series' increases always
        add up to the node's attributed energy and none ever decreases.
        """
        family = self._families[kind]
        totals = {
            tally.labels: tally.joules.of(kind)
            for tally in self._processes.values()
            if _ranks(kind, tally.joules)
        }
        gained = {
            self._processes[key].labels: joules.of(kind)
            for key, joules in increments.items()
            if _ranks(kind, joules)
        }
        rows = [_with(labels, kind, joules) for labels, joules in family.update(totals, gained)]
        if family.other is not None:
            rows.append(_with(WorkloadEnergy(pid="other"), kind, family.other))
        return tuple(rows)

    def containers(self) -> tuple[WorkloadEnergy, ...]:
        return tuple(self._containers[key].row() for key in sorted(self._containers))

    def pods(self) -> tuple[WorkloadEnergy, ...]:
        return tuple(self._pods[key].row() for key in sorted(self._pods))

    def _accumulate(
        self,
        owners: Mapping[ProcessKey, PodRef],
        increments: Mapping[ProcessKey, Joules],
        now: float,
    ) -> None:
        for key, owner in owners.items():
            pid, comm, container_id = key
            process = self._processes.get(key)
            if process is None or process.labels.owner != owner:
                labels = WorkloadEnergy(str(pid), comm, container_id, owner)
                process = self._processes.setdefault(key, Tally(labels, now))
                process.labels = labels
            increment = increments.get(key, Joules())
            for tally in (process, *self._levels(container_id, owner, now)):
                tally.seen = now
                tally.joules.cpu += increment.cpu
                tally.joules.gpu += increment.gpu

    def _accumulate_owned(self, owned: Mapping[Holder, float], now: float) -> None:
        """Adds device energy booked to its holder to that container and its pod."""
        for holder, joules in owned.items():
            for tally in self._levels(holder.container_id, holder.owner, now):
                tally.seen = now
                tally.joules.gpu += joules

    def _levels(self, container_id: str, owner: PodRef, now: float) -> tuple[Tally, Tally]:
        """The tallies of a container and of its pod, made on first use."""
        container_key = (container_id, owner.namespace, owner.pod, owner.container)
        pod_key = (owner.namespace, owner.pod)
        if container_key not in self._containers:
            self._containers[container_key] = Tally(
                WorkloadEnergy(container_id=container_id, owner=owner), now
            )
        if pod_key not in self._pods:
            self._pods[pod_key] = Tally(WorkloadEnergy(owner=PodRef(*pod_key)), now)
        return self._containers[container_key], self._pods[pod_key]

    def _expire(self, now: float, present: Mapping[ProcessKey, PodRef]) -> None:
        _forget(self._processes, now, self.grace)
        _forget(self._containers, now, self.grace)
        _forget(self._pods, now, self.grace)
        excess = len(self._processes) - self.max_processes
        if self.max_processes > 0 and excess > 0:
            absent = sorted(
                (key for key in self._processes if key not in present),
                key=lambda key: self._processes[key].joules.total,
            )
            for key in absent[:excess]:
                del self._processes[key]

    def state(self) -> dict[str, Any]:
        """Plain data for `carry.save`: each tally as its key, last sight and joules, and each
        kind's family as its `other` and the offsets of its shown series."""
        return {
            "processes": _tally_rows(
                ((*key, *_owner_cells(tally.labels.owner)), tally)
                for key, tally in self._processes.items()
            ),
            "containers": _tally_rows(self._containers.items()),
            "pods": _tally_rows(self._pods.items()),
            "families": {
                kind: {
                    "other": family.other,
                    "offsets": [
                        [*_labels_row(key), offset] for key, offset in family.offsets.items()
                    ],
                }
                for kind, family in self._families.items()
            },
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        processes = _tallies(carry.field(state, "processes"), integer, text, text, *POD)
        containers = _tallies(carry.field(state, "containers"), text, *POD)
        pods = _tallies(carry.field(state, "pods"), text, text)
        self._processes = {
            ProcessKey(*key[:3]): Tally(_labels([str(key[0]), *key[1:]]), seen, joules)
            for key, seen, joules in processes
        }
        self._containers = {
            key: Tally(_labels(["", "", *key]), seen, joules) for key, seen, joules in containers
        }
        self._pods = {
            key: Tally(_labels(["", "", "", *key, ""]), seen, joules) for key, seen, joules in pods
        }
        families = carry.field(state, "families")
        for kind, family in self._families.items():
            saved = carry.field(families, kind)
            found = carry.rows(carry.field(saved, "offsets"), *(text,) * 6, number)
            family.restore(
                optional_number(carry.field(saved, "other")),
                {_labels(list(cells[:6])): cells[6] for cells in found},
            )


POD = (text, text, text)  # namespace, pod, container


def _tally_rows(tallies: Iterable[tuple[tuple[Any, ...], Tally]]) -> list[list[Any]]:
    """[*key, last seen, cpu joules, gpu joules] of each (key, tally)."""
    return [[*key, tally.seen, tally.joules.cpu, tally.joules.gpu] for key, tally in tallies]


def _owner_cells(owner: PodRef) -> tuple[str, str, str]:
    return owner.namespace, owner.pod, owner.container


def _tallies(value: object, *key: Any) -> list[tuple[tuple[Any, ...], float, Joules]]:
    """(key, last seen, joules) of `_tally_rows`' rows, the key's cells checked by `key`."""
    return [
        (cells[: len(key)], cells[-3], Joules(cells[-2], cells[-1]))
        for cells in carry.rows(value, *key, number, number, number)
    ]


def _labels_row(labels: WorkloadEnergy) -> list[str]:
    """A process's labels as a row: pid, comm, container id, namespace, pod, container."""
    return [labels.pid, labels.comm, labels.container_id, *_owner_cells(labels.owner)]


def _labels(cells: list[str]) -> WorkloadEnergy:
    """The labels of a `_labels_row` row."""
    pid, comm, container_id, namespace, pod, container = cells
    return WorkloadEnergy(pid, comm, container_id, PodRef(namespace, pod, container))


def _ranks(kind: str, joules: Joules) -> bool:
    """Whether a process with these joules is in a kind's family: every process in the CPU's;
    in the GPU's once it has GPU energy (kthreadd or a kworker never has), kept from then on, as
    its joules never decrease."""
    return kind == "cpu" or joules.gpu > 0


def _with(labels: WorkloadEnergy, kind: str, joules: float) -> WorkloadEnergy:
    """The row of `labels` with `joules` of one kind."""
    if kind == "cpu":
        return dataclasses.replace(labels, cpu_joules=joules)
    return dataclasses.replace(labels, gpu_joules=joules)


def _forget(tallies: dict[K, Tally], now: float, grace: float) -> None:
    """Drop the tallies not seen for more than `grace` seconds."""
    for key in [key for key, tally in tallies.items() if now - tally.seen > grace]:
        del tallies[key]
