"""Which workloads the last sample had, and when the others were last seen; the containers of
the processes, counted so that a sample only looks at the processes that came, went or moved."""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from typing import Generic, Hashable, Iterable, Mapping, TypeVar

from kepler_bridge.model import PodRef, ProcessLabels

K = TypeVar("K", bound=Hashable)
ContainerKey = tuple[str, str, str, str]  # container id, namespace, pod, container
_CONTAINER_ID = itemgetter(2)


class Presence(Generic[K]):
    """Which keys of one level were in the last sample, and when each other one last was."""

    def __init__(self) -> None:
        self.present: set[K] = set()
        self.gone: dict[K, float] = {}

    def update(self, present: set[K], last_now: float) -> tuple[set[K], set[K]]:
        """Take this sample's keys (`last_now`: when the last sample was); the keys that came and
        those that went."""
        came, went = present - self.present, self.present - present
        self.gone.update(dict.fromkeys(went, last_now))
        for key in came:
            self.gone.pop(key, None)
        self.present = present
        return came, went

    def seen(self, key: K) -> float | None:
        """When the key was last in a sample; None: in the last one."""
        return None if key in self.present else self.gone[key]

    def expired(self, now: float, grace: float) -> list[K]:
        return [key for key, seen in self.gone.items() if now - seen > grace]

    def forget(self, key: K) -> None:
        self.gone.pop(key, None)
        self.present.discard(key)

    def restore(self, seen: Mapping[K, float | None]) -> None:
        self.present = {key for key, when in seen.items() if when is None}
        self.gone = {key: when for key, when in seen.items() if when is not None}


def container_key(container_id: str, owner: PodRef) -> ContainerKey:
    return container_id, owner.namespace, owner.pod, owner.container


class Containers:
    """How many of the last sample's processes each container has."""

    def __init__(self) -> None:
        self.counts: Counter[ContainerKey] | None = None  # None: to be counted at the next sample

    def count(self, owners: Mapping[ProcessLabels, PodRef]) -> None:
        """Count these processes; Python only sees each distinct pair of container id and owner
        object."""
        values = owners.values()
        by_id = dict(zip(map(id, values), values))
        counts: Counter[ContainerKey] = Counter()
        pairs = Counter(zip(map(_CONTAINER_ID, owners), map(id, values)))
        for (container_id, owner_id), processes in pairs.items():
            counts[container_key(container_id, by_id[owner_id])] += processes
        self.counts = counts

    def move(self, changes: Iterable[tuple[ProcessLabels, PodRef | None, PodRef | None]]) -> None:
        """Take processes from the container of their first owner to that of their second (None:
        the process went, or came)."""
        assert self.counts is not None
        for key, before, after in changes:
            if before is not None:
                container = container_key(key[2], before)
                self.counts[container] -= 1
                if not self.counts[container]:
                    del self.counts[container]
            if after is not None:
                self.counts[container_key(key[2], after)] += 1
