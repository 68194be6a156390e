"""The joules of every process, container and pod since the agent started; none ever decreases.

Every level only ever adds increases; a workload not seen for the grace
period is forgotten, and processes outside the top:N limit are summed into
one ``pid="other"`` series per kind. Only processes with GPU energy have GPU rows.

A sample's work grows with the processes that changed (used energy, came,
went or changed owner); what it does for all of them is done over whole
columns in C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, compress, filterfalse, repeat
from operator import attrgetter, gt, is_not
from typing import Any, Hashable, Iterable, Mapping, TypeVar

from kepler_bridge.model import Holder, PodRef, ProcessLabels, WorkloadEnergy, replaced
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.carry import integer, number, optional_number, text
from kepler_bridge.sampling.presence import ContainerKey, Containers, Presence, container_key
from kepler_bridge.sampling.top import ShownRows, TopCounter

KINDS = ("cpu", "gpu")  # the fields of Joules, and the `kind` of each per-process family
K = TypeVar("K", bound=Hashable)
PodKey = tuple[str, str]  # namespace, pod
_CPU, _GPU, _OWNER = attrgetter("joules.cpu"), attrgetter("joules.gpu"), attrgetter("labels.owner")
_OF_CPU, _OF_GPU = attrgetter("cpu"), attrgetter("gpu")
_JOULES = attrgetter("joules.cpu", "joules.gpu")


@dataclass(slots=True)
class Joules:
    """CPU and GPU joules: one workload's since the start, or one interval's increase."""

    cpu: float = 0.0
    gpu: float = 0.0

    @property
    def total(self) -> float:
        return self.cpu + self.gpu


@dataclass(slots=True)
class Tally:
    """The labels and joules of one process, container or pod."""

    labels: WorkloadEnergy
    joules: Joules = field(default_factory=Joules)

    def row(self) -> WorkloadEnergy:
        return replaced(self.labels, cpu_joules=self.joules.cpu, gpu_joules=self.joules.gpu)


# Stands for a process not tallied yet: its owner is no object an owner given to `add` can be.
_UNKNOWN = Tally(WorkloadEnergy(owner=PodRef()))


class Ledger:
    """Accumulated joules per process, container and pod; the top-N families of the process rows."""

    def __init__(self, *, process_limit: int | None, grace: float, max_processes: int) -> None:
        self._families: dict[str, TopCounter[ProcessLabels]] = {
            kind: TopCounter(process_limit) for kind in KINDS
        }
        self.configure(process_limit=process_limit, grace=grace, max_processes=max_processes)
        self._now: float | None = None  # of the last sample
        self._processes: dict[ProcessLabels, Tally] = {}
        self._cpu: dict[ProcessLabels, float] = {}  # each process's CPU joules, in the same order
        # Those with GPU joules, in the same order, and each key's place in `owners` while the
        # processes stay; None: to be worked out again.
        self._gpu: dict[ProcessLabels, float] | None = None
        self._place: dict[ProcessLabels, int] | None = None
        # The processes of the last sample and their owners, in its order.
        self._owner_keys: list[ProcessLabels] | None = []  # None: not known (a restored state)
        self._owner_values: list[PodRef] = []
        self._containers: dict[ContainerKey, Tally] = {}
        self._pods: dict[PodKey, Tally] = {}
        self._presence: tuple[Presence[Any], Presence[Any], Presence[Any]] = (
            Presence(),
            Presence(),
            Presence(),
        )
        self._counted = Containers()  # the containers of the processes
        self._rows = carry.Table(self._process_labels, self._process_numbers)
        self._offset_rows = {kind: carry.Rows() for kind in KINDS}
        self._shown: dict[str, ShownRows[ProcessLabels, WorkloadEnergy, WorkloadEnergy]] = {
            kind: ShownRows() for kind in KINDS
        }

    def configure(self, *, process_limit: int | None, grace: float, max_processes: int) -> None:
        """Set the settings; called again on reload, when the accumulated joules stay."""
        self.grace = grace
        self.max_processes = max_processes
        for family in self._families.values():
            family.limit = process_limit

    def add(
        self,
        owners: Mapping[ProcessLabels, PodRef],
        increments: Mapping[ProcessLabels, Joules],
        owned: Mapping[Holder, float],
        now: float,
    ) -> None:
        """Book one interval's increments on processes, their containers and pods, and the holders.

        Then forget what has been gone for the grace period.
        """
        last = now if self._now is None else self._now
        keys, values = list(owners), list(owners.values())
        same = keys == self._owner_keys  # the same processes: only those whose owner moved
        known = (
            self._owner_values
            if same
            else map(_OWNER, map(self._processes.get, keys, repeat(_UNKNOWN)))
        )
        changed, moved = self._join(owners, compress(keys, map(is_not, values, known)))
        came: set[ProcessLabels] = set()
        went: set[ProcessLabels] = set()
        if not same:
            came, went = self._presence[0].update(set(owners), last)
        self._owner_keys, self._owner_values = keys, values
        self._count(owners, came, went, moved)
        assert self._counted.counts is not None  # counted just now
        containers = set(self._counted.counts) | {
            container_key(h.container_id, h.owner) for h in owned
        }
        self._presence[1].update(containers, last)
        self._presence[2].update({key[1:3] for key in containers}, last)
        self._accumulate(self._in_order(keys, same, increments), increments, owned)
        self._rows.relabelled(chain(changed, came, went))  # their owner or last sight
        # A GPU process's increment is often none (an idle GPU): its row is as it was.
        self._rows.changed([key for key, joules in increments.items() if joules.cpu or joules.gpu])
        self._now = now
        self._expire(now, owners)

    def process_rows(
        self, increments: Mapping[ProcessLabels, Joules], kind: str
    ) -> tuple[WorkloadEnergy, ...]:
        """One kind's per-process rows: the top N by its joules, and pid="other" once one is out.

        A shown series counts from the sample its process entered the top N
        (what it used before went to "other"), so the series' increases always
        add up to the node's attributed energy and none ever decreases.
        """
        family, processes = self._families[kind], self._processes
        if kind == "cpu":  # every process is in the CPU's family
            totals = self._cpu
            gained = dict(zip(increments, map(_OF_CPU, increments.values())))
        else:  # only processes with GPU energy (kthreadd or a kworker never has): joules never
            # decrease, so once there, they stay
            if self._gpu is None:
                gpu = list(map(_GPU, processes.values()))
                self._gpu = dict(compress(zip(processes, gpu), gpu))
            totals = self._gpu
            grew = list(map(_OF_GPU, increments.values()))
            gained = dict(compress(zip(increments, grew), map(gt, grew, repeat(0))))
        rows = self._shown[kind].rows(
            family.update(totals, gained),
            lambda key: processes[key].labels,
            lambda labels, joules: _with(labels, kind, joules),
        )
        if family.other is not None:
            rows.append(_with(WorkloadEnergy(pid="other"), kind, family.other))
        return tuple(rows)

    def containers(self) -> tuple[WorkloadEnergy, ...]:
        return tuple(self._containers[key].row() for key in sorted(self._containers))

    def pods(self) -> tuple[WorkloadEnergy, ...]:
        return tuple(self._pods[key].row() for key in sorted(self._pods))

    def _join(
        self, owners: Mapping[ProcessLabels, PodRef], looked_at: Iterable[ProcessLabels]
    ) -> tuple[list[ProcessLabels], list[tuple[ProcessLabels, PodRef]]]:
        """Make the tallies of new processes and give their owner to those `looked_at` (whose
        owner is not the very object of their tally): those whose labels changed, and those of
        them that moved, with the owner they had."""
        processes, changed, moved = self._processes, [], []
        for key in looked_at:
            pid, comm, container_id = key
            owner, tally = owners[key], processes.get(key)
            labels = WorkloadEnergy(str(pid), comm, container_id, owner)
            if tally is None:
                processes[key] = Tally(labels)
                self._cpu[key] = 0.0
                changed.append(key)
                continue
            if tally.labels.owner != owner:  # else the same owner in a new object
                changed.append(key)
                moved.append((key, tally.labels.owner))
                for family in self._families.values():
                    family.restart(key)  # its series has new labels
            tally.labels = labels
        return changed, moved

    def _count(
        self,
        owners: Mapping[ProcessLabels, PodRef],
        came: set[ProcessLabels],
        went: set[ProcessLabels],
        moved: list[tuple[ProcessLabels, PodRef]],
    ) -> None:
        """Count the processes of each container: those that came, went or moved, or all of them
        where nothing is counted yet."""
        if self._counted.counts is None:
            self._counted.count(owners)
            return
        owner = lambda key: self._processes[key].labels.owner  # noqa: E731
        self._counted.move(
            chain(
                ((key, before, owner(key)) for key, before in moved if key not in came),
                ((key, None, owner(key)) for key in came),
                ((key, owner(key), None) for key in went),
            )
        )

    def _in_order(
        self, keys: list[ProcessLabels], same: bool, increments: Mapping[ProcessLabels, Joules]
    ) -> list[ProcessLabels]:
        """The processes with increments, in the order of the sample's processes: sorted by their
        place while the processes stay the same, else picked out of all."""
        if not same:
            self._place = None
            return list(filter(increments.__contains__, keys))
        if self._place is None:
            self._place = dict(zip(keys, range(len(keys))))
        return sorted(increments, key=self._place.__getitem__)

    def _accumulate(
        self,
        ordered: list[ProcessLabels],
        increments: Mapping[ProcessLabels, Joules],
        owned: Mapping[Holder, float],
    ) -> None:
        """Adds the increments (in the order of `ordered`) to processes, containers and pods,
        then device energy booked to a holder to that container and its pod."""
        for container in self._presence[1].present - self._containers.keys():
            self._containers[container] = Tally(
                WorkloadEnergy(container_id=container[0], owner=PodRef(*container[1:]))
            )
        for pod in self._presence[2].present - self._pods.keys():
            self._pods[pod] = Tally(WorkloadEnergy(owner=PodRef(*pod)))
        self._book(ordered, increments)
        for holder, added in owned.items():
            owner = holder.owner
            self._containers[
                (holder.container_id, owner.namespace, owner.pod, owner.container)
            ].joules.gpu += added
            self._pods[(owner.namespace, owner.pod)].joules.gpu += added

    def _book(
        self, ordered: list[ProcessLabels], increments: Mapping[ProcessLabels, Joules]
    ) -> None:
        """Add each process's increment to it, its container and its pod, in the order given."""
        processes, cpu_totals = self._processes, self._cpu
        containers, pods = self._containers, self._pods
        last: tuple[PodRef | None, str] = (None, "")
        tallies: tuple[Joules, ...] = ()
        for key in ordered:
            increment, process = increments[key], processes[key]
            cpu, gpu, joules = increment.cpu, increment.gpu, process.joules
            if gpu > 0 and not joules.gpu:
                self._gpu = None  # its first GPU energy: it joins the GPU family
            joules.cpu += cpu
            joules.gpu += gpu
            cpu_totals[key] = joules.cpu
            if self._gpu is not None and key in self._gpu:
                self._gpu[key] = joules.gpu
            owner = process.labels.owner
            if owner is not last[0] or key[2] != last[1]:  # else those of the process before
                last = owner, key[2]
                tallies = (
                    containers[(key[2], owner.namespace, owner.pod, owner.container)].joules,
                    pods[(owner.namespace, owner.pod)].joules,
                )
            for joules in tallies:
                joules.cpu += cpu
                joules.gpu += gpu

    def _expire(self, now: float, present: Mapping[ProcessLabels, PodRef]) -> None:
        levels: tuple[dict[Any, Tally], ...] = (self._processes, self._containers, self._pods)
        for tallies, presence in zip(levels, self._presence):
            for key in presence.expired(now, self.grace):
                del tallies[key]
                presence.forget(key)
                if tallies is self._processes:
                    self._drop(key)
        excess = len(self._processes) - self.max_processes
        if self.max_processes > 0 and excess > 0:
            absent = sorted(
                filterfalse(present.__contains__, self._processes),
                key=lambda key: self._processes[key].joules.total,
            )
            for key in absent[:excess]:
                del self._processes[key]
                self._presence[0].forget(key)
                self._drop(key)

    def _drop(self, key: ProcessLabels) -> None:
        """Forget the totals and the row of a process whose tally is gone."""
        del self._cpu[key]
        if self._gpu is not None:
            self._gpu.pop(key, None)
        self._rows.removed((key,))

    def _process_labels(self, key: ProcessLabels) -> tuple[Any, ...]:
        owner = self._processes[key].labels.owner
        return (*key, *_owner_cells(owner), self._presence[0].seen(key))

    def _process_numbers(self, keys: list[ProcessLabels]) -> Iterable[tuple[float, float]]:
        return map(_JOULES, map(self._processes.__getitem__, keys))

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`: the last sample's time; each tally as its key, when it
        was last seen (None: in the last sample) and its joules; and each kind's family as its
        `other` and the offsets of its shown series."""
        containers, pods = self._presence[1:]
        return {
            "now": self._now,
            "processes": self._rows,
            "containers": _tally_rows(self._containers, containers),
            "pods": _tally_rows(self._pods, pods),
            "families": {
                kind: {
                    "other": family.other,
                    "offsets": self._offset_rows[kind].of(family.offsets),
                }
                for kind, family in self._families.items()
            },
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        now = optional_number(carry.field(state, "now"))
        processes = _tallies(carry.field(state, "processes"), integer, text, text, *POD)
        containers = _tallies(carry.field(state, "containers"), text, *POD)
        pods = _tallies(carry.field(state, "pods"), text, text)
        if now is None and any(seen is None for _, seen, _ in processes + containers + pods):
            raise carry.BadState("present workloads without the time of the last sample")
        self._now = now
        self._processes = {
            key[:3]: Tally(WorkloadEnergy(str(key[0]), key[1], key[2], PodRef(*key[3:])), joules)
            for key, _, joules in processes
        }
        self._containers = {
            key: Tally(WorkloadEnergy(container_id=key[0], owner=PodRef(*key[1:])), joules)
            for key, _, joules in containers
        }
        self._pods = {
            key: Tally(WorkloadEnergy(owner=PodRef(*key)), joules) for key, _, joules in pods
        }
        for presence, found in zip(self._presence, (processes, containers, pods)):
            cut = 3 if presence is self._presence[0] else None
            presence.restore({key[:cut]: seen for key, seen, _ in found})
        self._cpu = dict(zip(self._processes, map(_CPU, self._processes.values())))
        self._gpu = self._place = None
        self._owner_keys, self._owner_values = None, []
        self._counted.counts = None
        self._rows.clear()
        self._rows.changed(self._processes)
        families = carry.field(state, "families")
        for kind, family in self._families.items():
            saved = carry.field(families, kind)
            shown = carry.rows(carry.field(saved, "offsets"), integer, text, text, number)
            family.restore(
                optional_number(carry.field(saved, "other")),
                {(pid, comm, cid): offset for pid, comm, cid, offset in shown},
            )


POD = (text, text, text)  # namespace, pod, container


def _tally_rows(tallies: Mapping[Any, Tally], presence: Presence[Any]) -> list[list[Any]]:
    """[*key, last seen (None: in the last sample), cpu joules, gpu joules] of each tally."""
    return [
        [*key, presence.seen(key), tally.joules.cpu, tally.joules.gpu]
        for key, tally in tallies.items()
    ]


def _owner_cells(owner: PodRef) -> tuple[str, str, str]:
    return owner.namespace, owner.pod, owner.container


def _tallies(value: object, *key: Any) -> list[tuple[tuple[Any, ...], float | None, Joules]]:
    """(key, last seen, joules) of the rows of a level, the key's cells checked by `key`."""
    return [
        (cells[: len(key)], cells[-3], Joules(cells[-2], cells[-1]))
        for cells in carry.rows(value, *key, optional_number, number, number)
    ]


def _with(labels: WorkloadEnergy, kind: str, joules: float) -> WorkloadEnergy:
    """The row of `labels` with `joules` of one kind."""
    if kind == "cpu":
        return replaced(labels, cpu_joules=joules)
    return replaced(labels, gpu_joules=joules)
