"""The processes a CPU source reports: pid reuse, a grace period for ended ones, and a cap.

Shared by the ebpf and procfs sources. Rules:

- a process is (pid, start time); a pid seen with a new start time is a new
  process, and when both carry the same labels the newer one is reported;
- an ended process keeps its last counter for ``grace`` seconds, then goes;
- at most ``max_processes`` entries are kept (0 = no cap): the ones with the
  most CPU seconds, live or ended (the newest go first among equals). An evicted
  live process that keeps running comes back with its whole counter, read again
  from its source once it has run past the least kept; until then the source
  does not read it whole again (`shut_out`).
- reported counters never decrease for the same process.

A source changes a tracked process only through the table (`count`, `relabel`, `end`,
`revive`), so the table remakes the rows of the processes that changed, keeps the others' from
the last sample, and looks only at ended processes for the grace period.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Collection

from kepler_bridge.config import Config
from kepler_bridge.model import ProcessCpu, ProcessKey
from kepler_bridge.sources.base import Source

_SECONDS = attrgetter("cpu_seconds")


@dataclass(slots=True)
class TrackedProcess:
    """One process; ``start`` is its start time after boot (clock ticks for procfs,
    nanoseconds for ebpf). It changes through the table: count, relabel, end and revive."""

    pid: int
    start: int
    comm: str
    container_id: str
    cpu_seconds: float
    ended_at: float | None = None
    # Kept by the ebpf source to notice exec (comm change) and cgroup moves cheaply.
    raw_comm: bytes = b""
    cgroup_id: int = 0
    # Kept by the procfs source: the last /proc/<pid>/stat line, not parsed again while the same,
    # and the last /proc/<pid>/cgroup text with when it is next read (`clock` time).
    raw_stat: bytes = b""
    raw_cgroup: bytes = b""
    cgroup_due: float = 0.0


class ProcessTable:
    """Processes being reported, bounded in number and in how long ended ones stay."""

    def __init__(
        self, max_processes: int, grace: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.configure(max_processes, grace)
        self.clock = clock
        self._entries: dict[tuple[int, int], TrackedProcess] = {}
        self._current: dict[int, tuple[int, int]] = {}
        # The row of each entry, in the entries' order, and the entries whose row is to be made
        # again (a dict: new entries get their rows in the order they began).
        self._rows: dict[tuple[int, int], ProcessCpu] = {}
        self._stale: dict[tuple[int, int], None] = {}
        self._ended: dict[tuple[int, int], float] = {}  # the ended entries, and when they ended
        self.evicted: list[int] = []  # pids of live processes the cap dropped at the last rows()
        # The live processes the cap keeps out, and the fewest CPU seconds of those it kept: one
        # read again with no more stays out without being read whole (`shut_out`).
        self._out: dict[tuple[int, int], None] = {}
        self._still_out: dict[tuple[int, int], None] = {}
        self._bar = 0.0

    def configure(self, max_processes: int, grace: float) -> None:
        """The cap and the grace period from now on (a reload); entries already kept follow them."""
        self.max_processes = max_processes
        self.grace = grace

    def __len__(self) -> int:
        return len(self._entries)

    def current(self, pid: int) -> TrackedProcess | None:
        """The newest process seen with this pid, live or ended."""
        key = self._current.get(pid)
        return self._entries.get(key) if key else None

    def find(self, pid: int, start: int) -> TrackedProcess | None:
        """The process with this pid and start time, live or ended, if tracked."""
        return self._entries.get((pid, start))

    def begin(
        self, pid: int, start: int, comm: str, container_id: str, cpu_seconds: float
    ) -> TrackedProcess:
        """Track a process first seen now; a newer start than the pid's current process means
        the old one ended."""
        old = self.current(pid)
        entry = TrackedProcess(pid, start, comm, container_id, cpu_seconds)
        key = (pid, start)
        self._entries[key] = entry
        self._stale[key] = None
        self._ended.pop(key, None)
        # An older process reported late (it ended before a newer one took its pid)
        # leaves the newer current.
        if old is None or old.start < start:
            if old is not None:
                self.end(old)
            self._current[pid] = key
        return entry

    def shut_out(self, pid: int, start: int, cpu_seconds: float) -> bool:
        """Whether a process the cap evicted, read again with these CPU seconds, stays out (no
        more than the least the cap kept): then the source neither reads nor begins it."""
        key = (pid, start)
        if key not in self._out or cpu_seconds > self._bar:
            return False
        self._still_out[key] = None
        return True

    def count(self, entry: TrackedProcess, cpu_seconds: float) -> None:
        """The process's CPU seconds read again; the counter never goes down."""
        if cpu_seconds > entry.cpu_seconds:
            entry.cpu_seconds = cpu_seconds
            self._stale[(entry.pid, entry.start)] = None

    def relabel(self, entry: TrackedProcess, comm: str, container_id: str) -> None:
        """The process's comm (after exec) and container (after a cgroup move)."""
        if comm != entry.comm or container_id != entry.container_id:
            entry.comm, entry.container_id = comm, container_id
            self._stale[(entry.pid, entry.start)] = None

    def end(self, entry: TrackedProcess) -> None:
        """Mark a process ended now (its counter stays for the grace period)."""
        if entry.ended_at is None:
            entry.ended_at = self._ended[(entry.pid, entry.start)] = self.clock()

    def revive(self, entry: TrackedProcess) -> None:
        """A process marked ended is seen alive again (it was hidden from a read)."""
        if entry.ended_at is not None:
            entry.ended_at = None
            del self._ended[(entry.pid, entry.start)]

    def end_missing(self, alive: Collection[int]) -> None:
        """End every live process whose pid is not in alive."""
        now = self.clock()
        for key, entry in self._entries.items():
            if entry.ended_at is None and entry.pid not in alive:
                entry.ended_at = self._ended[key] = now

    def rows(self) -> tuple[ProcessCpu, ...]:
        """Expire and cap, then the rows to report."""
        self._expire()
        self._cap()
        for key in self._stale:
            e = self._entries[key]
            self._rows[key] = ProcessCpu(e.pid, e.comm, e.cpu_seconds, e.container_id, e.start)
        self._stale.clear()
        if len(self._rows) == len(self._current):  # one process per pid: no labels are shared
            return tuple(self._rows.values())
        by_labels: dict[ProcessKey, tuple[int, ProcessCpu]] = {}
        for (_, start), row in self._rows.items():
            shown = by_labels.get(row.key)
            if shown is None or shown[0] < start:  # the newer process with the same labels wins
                by_labels[row.key] = (start, row)
        return tuple(row for _, row in by_labels.values())

    def _expire(self) -> None:
        now = self.clock()
        for key in [key for key, at in self._ended.items() if now - at >= self.grace]:
            self._drop(key)

    def _cap(self) -> None:
        self.evicted = []
        self._out, self._still_out = self._still_out, {}
        excess = len(self._entries) - self.max_processes
        if self.max_processes <= 0 or excess < 0:
            self._out.clear()  # room again: those kept out come back at the next read
            return
        if excess == 0:
            self._bar = min(map(_SECONDS, self._entries.values()), default=0.0)
            return
        # Newest first among equals: an evicted process read again as new, no bigger than those
        # kept, goes again, instead of pushing out one kept (every sample, for ever, when idle).
        ranked = sorted(reversed(self._entries), key=lambda key: self._entries[key].cpu_seconds)
        for key in ranked[:excess]:
            if self._entries[key].ended_at is None:
                self.evicted.append(key[0])
                self._out[key] = None
            self._drop(key)
        self._bar = self._entries[ranked[excess]].cpu_seconds if excess < len(ranked) else 0.0

    def _drop(self, key: tuple[int, int]) -> None:
        del self._entries[key]
        self._rows.pop(key, None)
        self._stale.pop(key, None)
        self._ended.pop(key, None)
        if self._current.get(key[0]) == key:
            del self._current[key[0]]


class ProcessSource(Source):
    """A CPU source keeping its processes in a ProcessTable (--max-processes, --process-grace)."""

    def __init__(self, config: Config) -> None:
        self.table = ProcessTable(config.max_processes, config.process_grace)
        super().__init__(config)

    def configure(self, config: Config) -> None:
        super().configure(config)
        self.table.configure(config.max_processes, config.process_grace)
