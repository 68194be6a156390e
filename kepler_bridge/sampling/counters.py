"""Keeps exported counters monotonic across device resets (`device_counters`), lost GPUs and
process churn."""

from __future__ import annotations

from itertools import compress, count, islice, repeat
from operator import add, attrgetter, is_not, itemgetter, ne, sub
from typing import Any, Iterable, Mapping

from kepler_bridge.model import GpuReading, ProcessCpu, ProcessLabels, process_labels
from kepler_bridge.sampling import carry, monotonic
from kepler_bridge.sampling.carry import integer, number, optional_number, text
from kepler_bridge.sampling.device_counters import DeviceCounters
from kepler_bridge.sampling.monotonic import increase
from kepler_bridge.sampling.top import ShownRows, TopCounter

_SECONDS = attrgetter("cpu_seconds")
_START = attrgetter("start")
MAX_DEPARTED = 1024  # processes left out of a sample whose last seconds are remembered
_CONTAINER_ID = itemgetter(2)


def _relabelled(
    last: Mapping[ProcessLabels, float],
    seen: Mapping[ProcessLabels, float],
    gone: set[ProcessLabels],
    new: set[ProcessLabels],
    starts: tuple[Mapping[ProcessLabels, int], Mapping[ProcessLabels, int]],
) -> dict[ProcessLabels, float]:
    """The `new` keys of processes whose labels changed, each with its seconds under the old
    ones: its pid's among the `gone` keys of `last`, where its counter in `seen` did not drop and
    its start is the one it had (`starts`: then, where known, and now)."""
    then, now = starts
    old = {key[0]: (last[key], then.get(key)) for key in gone}
    return {
        key: old[key[0]][0]
        for key in new
        if key[0] in old and seen[key] >= old[key[0]][0] and old[key[0]][1] in (None, now[key])
    }


def _returned(
    departed: tuple[dict[ProcessLabels, float], dict[ProcessLabels, int]],
    seen: Mapping[ProcessLabels, float],
    new: set[ProcessLabels],
    now: Mapping[ProcessLabels, int],
    rows: carry.Table,
) -> dict[ProcessLabels, float]:
    """The `new` keys that left an earlier sample, each with its seconds then (taken out of
    `departed`, seconds and starts, and its `rows`), where its counter did not drop and its start
    (`now`) is the one it had, if known (else a new process with the same labels)."""
    seconds_then, starts_then = departed
    found = {key: seconds_then.pop(key) for key in new if key in seconds_then}
    rows.removed(found)
    started = {key: starts_then.pop(key, None) for key in found}
    return {
        key: seconds
        for key, seconds in found.items()
        if seen[key] >= seconds and started[key] in (None, now[key])
    }


class MonotonicCounters:
    """Per-device (`DeviceCounters`), per-process and per-container counter state owned by the
    sampler thread.

    The per-process work of a sample is done over whole columns, in C where it can: with
    thousands of processes, most of which did not run, Python only touches the ones that did."""

    def __init__(self, process_limit: int | None = None) -> None:
        self.devices = DeviceCounters()
        self._process_seen: dict[ProcessLabels, float] = {}
        # The last seconds of processes left out of a sample (the --max-processes cap leaves out
        # those that run least), the newest MAX_DEPARTED: one that comes back counts from there.
        self._departed: dict[ProcessLabels, float] = {}
        self._departed_start: dict[ProcessLabels, int] = {}  # where known (not saved)
        self._process_total: dict[ProcessLabels, float] = {}
        self._process_family: TopCounter[ProcessLabels] = TopCounter(process_limit)
        self._container_total: dict[str, float] = {}
        # The last sample's keys in its order, and its CPU seconds and totals' keys in that order;
        # None: not known (a restored state).
        self._keys: list[ProcessLabels] | None = []
        self._seconds: list[float] = []
        self._starts: list[int] = []  # the start of each of `_keys`' processes
        self._last_rows: tuple[ProcessCpu, ...] = ()  # the rows `_keys` and `_seconds` came from
        self._total_keys: list[ProcessLabels] | None = []
        self._shown: ShownRows[ProcessLabels, ProcessLabels, ProcessCpu] = ShownRows()
        # [pid, comm, container id, last CPU seconds, total] of each process of the last sample.
        self._rows = carry.Table(carry.own_cells, self._process_numbers)
        # [pid, comm, container id, last CPU seconds] of each departed process.
        self._departed_rows = carry.Table(carry.own_cells, self._departed_numbers)
        self._offset_rows = carry.Rows()
        self._rebase = False

    def new_cpu_source(self) -> None:
        """Another source reads CPU time than the restored counts came from (no eBPF in this
        worker): each known process's next reading is its baseline (a drop would count it again)."""
        self._rebase = True

    def configure(self, process_limit: int | None) -> None:
        """A new --process-metrics: series shown from now on follow it; none decreases."""
        self._process_family.limit = process_limit

    def forget(self, uuids: Iterable[str]) -> None:
        """Drop the counters of devices gone for good: if one comes back, they start again."""
        self.devices.forget(uuids)

    def gpu(self, reading: GpuReading, now: float) -> GpuReading:
        """The reading with its counters made monotonic per device uuid (`DeviceCounters.gpu`)."""
        return self.devices.gpu(reading, now)

    def cpu_increases(self, processes: Iterable[ProcessCpu]) -> dict[ProcessLabels, float]:
        """CPU seconds each process used since the last call; one seen for the first time counts
        whole, one whose counter dropped or whose start changed (a new process with the same
        labels) counts from zero. A process whose labels changed, or that comes back after being
        left out, counts on from what was counted (`_counted`)."""
        rows = tuple(processes)
        if self._rebase:
            self._rebase = False
            now = dict(zip(map(process_labels, rows), map(_SECONDS, rows)))
            self._rows.changed(monotonic.rebased(self._process_seen, now))
            self._departed_rows.changed(monotonic.rebased(self._departed, now))
            self._departed_start.clear()
            self._keys = None  # the other source's starts are not this one's
        replaced_at = self._replaced_rows(rows)
        if replaced_at is not None:
            return self._same_processes(rows, replaced_at)
        keys = list(map(process_labels, rows))
        seconds, starts = list(map(_SECONDS, rows)), list(map(_START, rows))
        if keys == self._keys and len(keys) == len(self._process_seen) and starts == self._starts:
            return self._same_processes(
                rows, list(compress(count(), map(ne, seconds, self._seconds)))
            )
        last, seen = self._process_seen, dict(zip(keys, seconds))
        gone, new = last.keys() - seen.keys(), seen.keys() - last.keys()
        before = self._counted(keys, seen, gone, new, starts)
        gained = list(map(sub, seconds, before))
        if gained and min(gained) < 0:
            gained = list(map(increase, before, seconds))
        self._process_seen = seen
        self._keys, self._seconds, self._starts, self._last_rows = keys, seconds, starts, rows
        self._rows.changed(compress(keys, map(ne, seconds, before)))
        self._rows.changed(new)
        self._rows.removed(gone)
        if len(seen) < len(keys):  # a key twice: the last row of it counts
            return dict(zip(keys, gained))
        increases = dict.fromkeys(seen, 0.0)
        increases.update(compress(zip(keys, gained), gained))
        return increases

    def _counted(
        self,
        keys: list[ProcessLabels],
        seen: Mapping[ProcessLabels, float],
        gone: set[ProcessLabels],
        new: set[ProcessLabels],
        starts: list[int],
    ) -> list[float]:
        """The seconds counted already of each key: the last sample's unless its process started
        again (`starts`); for a `new` key whose labels changed (exec, a cgroup move: its pid
        `gone` under the old labels, its counter not below theirs, its start the same) those under
        the old labels, for one back after being left out those it had then; else 0. The
        processes `gone` are remembered."""
        last = self._process_seen
        before = list(map(last.get, keys, repeat(0.0)))
        then = {} if self._keys is None else dict(zip(self._keys, self._starts))
        for at in compress(count(), map(ne, starts, map(then.get, keys, starts))):
            before[at] = 0.0  # its pid was taken again by a process with the same labels
        now = dict(zip(keys, starts)) if new and (gone or self._departed) else {}
        if gone and new:
            relabelled = _relabelled(last, seen, gone, new, (then, now))
            if relabelled:
                before = list(map(relabelled.get, keys, before))
        if new and self._departed:
            departed = (self._departed, self._departed_start)
            returned = _returned(departed, seen, new, now, self._departed_rows)
            if returned:
                before = list(map(returned.get, keys, before))
        if gone:
            self._depart(last, gone, then)
        return before

    def _depart(
        self,
        last: Mapping[ProcessLabels, float],
        gone: set[ProcessLabels],
        then: Mapping[ProcessLabels, int],
    ) -> None:
        """Remember the last seconds (and starts, where known: `then`) of the processes `gone`
        from this sample, the newest MAX_DEPARTED."""
        departed = self._departed
        departed.update(zip(gone, map(last.__getitem__, gone)))
        self._departed_start.update((key, then[key]) for key in gone if key in then)
        self._departed_rows.changed(gone)
        oldest = list(islice(departed, max(len(departed) - MAX_DEPARTED, 0)))
        for key in oldest:
            del departed[key]
            self._departed_start.pop(key, None)
        self._departed_rows.removed(oldest)

    def _replaced_rows(self, rows: tuple[ProcessCpu, ...]) -> list[int] | None:
        """The places of the rows that are not the very objects of the last sample's (eBPF gives
        a new row only for a process that ran), if they are few and have the labels of the last
        sample's at their place; else None: the rows are compared whole, in C."""
        keys, last = self._keys, self._last_rows
        if keys is None or len(rows) != len(last) or len(keys) != len(self._process_seen):
            return None
        replaced_at = list(compress(count(), map(is_not, rows, last)))
        if len(replaced_at) * 4 > len(rows):  # new rows every sample (procfs)
            return None
        if any(process_labels(rows[at]) != keys[at] for at in replaced_at):
            return None
        return replaced_at

    def _same_processes(
        self, rows: tuple[ProcessCpu, ...], places: list[int]
    ) -> dict[ProcessLabels, float]:
        """`cpu_increases` of the last sample's processes, in the same order: only the rows at
        `places` are looked at, and the keys stay the very objects of the last sample."""
        keys, last, seen, starts = self._keys or [], self._seconds, self._process_seen, self._starts
        increases = dict.fromkeys(seen, 0.0)
        moved: list[ProcessLabels] = []
        for at in places:
            row = rows[at]
            seconds = row.cpu_seconds
            if row.start != starts[at]:  # its pid taken again under the same labels: counts whole
                increases[keys[at]], starts[at] = seconds, row.start
            elif seconds != last[at]:
                increases[keys[at]] = increase(last[at], seconds)
            else:
                continue
            seen[keys[at]] = last[at] = seconds
            moved.append(keys[at])
        self._last_rows = rows
        self._rows.changed(moved)
        return increases

    def process_seconds(
        self, increases: Mapping[ProcessLabels, float]
    ) -> tuple[tuple[ProcessCpu, ...], float | None]:
        """The shown processes (top N by CPU seconds) with their series' values, and the seconds of
        all the others (None before any was left out); a process's total adds up its increases, so
        it never decreases. `increases`: what `cpu_increases` gave last."""
        last = self._process_total
        grew = dict(compress(increases.items(), increases.values()))
        keys = list(increases)
        if keys == self._total_keys:  # the same processes: only those that ran are looked at
            for key, seconds in grew.items():
                last[key] += seconds
        else:
            self._process_total = dict(
                zip(keys, map(add, map(last.get, keys, repeat(0.0)), increases.values()))
            )
            self._total_keys = keys
        self._rows.changed(grew)  # cpu_increases marked the new and the gone
        shown = self._process_family.update(self._process_total, grew)
        rows = self._shown.rows(shown, carry.own_cells, _process_row)
        return tuple(rows), self._process_family.other

    def containers(self, increases: Mapping[ProcessLabels, float]) -> tuple[tuple[str, float], ...]:
        """Per-container CPU seconds as sums of process increases, so a process leaving never
        lowers a total."""
        totals = self._container_total
        present = set(map(_CONTAINER_ID, increases))
        present.discard("")
        totals.update(dict.fromkeys(present - totals.keys(), 0.0))
        for (_, _, container_id), seconds in compress(increases.items(), increases.values()):
            if container_id:
                totals[container_id] += seconds
        for container in totals.keys() - present:
            del totals[container]
        return tuple(sorted(totals.items()))

    def _process_numbers(self, keys: list[ProcessLabels]) -> Iterable[tuple[float, float]]:
        seen, total = self._process_seen, self._process_total
        return zip(map(seen.__getitem__, keys), map(total.get, keys, repeat(0.0)))

    def _departed_numbers(self, keys: list[ProcessLabels]) -> Iterable[tuple[float]]:
        return zip(map(self._departed.__getitem__, keys))

    def state(self) -> dict[str, Any]:
        """Plain data for `StateFile.save`; `restore` takes it back."""
        return {
            **self.devices.state(),
            "processes": self._rows,
            "departed": self._departed_rows,
            "process_other": self._process_family.other,
            "process_offsets": self._offset_rows.of(self._process_family.offsets),
            "containers": [[cid, seconds] for cid, seconds in self._container_total.items()],
        }

    def restore(self, state: object) -> None:
        """Take the state a previous worker saved; raises carry.BadState on a wrong value."""
        self.devices.restore(state)
        rows = carry.rows(carry.field(state, "processes"), integer, text, text, number, number)
        self._process_seen = {(pid, comm, cid): seen for pid, comm, cid, seen, _ in rows}
        self._process_total = {(pid, comm, cid): total for pid, comm, cid, _, total in rows}
        self._keys = self._total_keys = None
        self._rows.clear()
        self._rows.changed(self._process_seen)
        left = carry.rows(carry.field(state, "departed"), integer, text, text, number)
        self._departed = {(pid, comm, cid): seconds for pid, comm, cid, seconds in left}
        self._departed_start = {}
        self._departed_rows.clear()
        self._departed_rows.changed(self._departed)
        self._process_family.restore(
            optional_number(carry.field(state, "process_other")),
            _process_values(carry.field(state, "process_offsets")),
        )
        found = carry.rows(carry.field(state, "containers"), text, number)
        self._container_total = {cid: seconds for cid, seconds in found}


def _process_values(value: object) -> dict[ProcessLabels, float]:
    """Rows [pid, comm, container id, value] as a mapping by process."""
    found = carry.rows(value, integer, text, text, number)
    return {(pid, comm, cid): seconds for pid, comm, cid, seconds in found}


def _process_row(key: ProcessLabels, seconds: float) -> ProcessCpu:
    pid, comm, container_id = key
    return ProcessCpu(pid, comm, seconds, container_id)
