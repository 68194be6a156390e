"""CPU time per process from /proc/<pid>/stat: the fallback when eBPF cannot load.

It sees only processes alive at a sample; one that starts and ends between
two samples is missed (the ebpf source counts those). A process's cgroup is
read when it is first seen, then again when it has run and CGROUP_RECHECK
seconds have passed since the last read: a process moved to another container
is booked to it from then on. With ``--procfs /host/proc`` and hostPID the pids
and comms are the host's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kepler_bridge.model import CpuTimes, SourceReading
from kepler_bridge.sources.base import SourceAbsent
from kepler_bridge.sources.cgroup import container_id, read_raw_cgroup
from kepler_bridge.sources.process_table import ProcessSource, TrackedProcess

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STAT_BYTES = 4096
# Seconds between two reads of a running process's cgroup: how long after a move its CPU time may
# still go to the container it left (one read per process that ran, at most, every 5 s).
CGROUP_RECHECK = 5.0


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the agent uses."""

    pid: int
    comm: str
    start: int
    cpu_seconds: float


def parse_stat(pid: int, text: str) -> ProcStat:
    """Parse /proc/<pid>/stat; the comm may itself hold spaces and parentheses."""
    open_paren, close_paren = text.index("("), text.rindex(")")
    fields = text[close_paren + 2 :].split()
    # fields[0] is field 3 (state): utime 14, stime 15, starttime 22.
    utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
    return ProcStat(pid, text[open_paren + 1 : close_paren], start, (utime + stime) / CLOCK_TICKS)


def read_stat(procfs: str, pid: int) -> ProcStat | None:
    """The stat of a live process (or thread id); None when it is gone, hidden (hidepid, an LSM)
    or truncated."""
    raw = read_raw_stat(procfs, pid)
    try:
        return None if raw is None else parse_stat(pid, raw.decode(errors="replace"))
    except (ValueError, IndexError):
        return None


def read_raw_stat(procfs: str, pid: int) -> bytes | None:
    """The /proc/<pid>/stat line as it is; None when the process is gone or hidden."""
    # os.read: half the cost of a file object, read once per process per sample. The kernel
    # writes the whole line (well under STAT_BYTES) in one read.
    try:
        fd = os.open(f"{procfs}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, STAT_BYTES)
        finally:
            os.close(fd)
    except OSError:
        return None


def read_cpu_times(procfs: str) -> CpuTimes:
    """Busy and total CPU seconds of all CPUs from <procfs>/stat; steal time belongs to neither."""
    with open(f"{procfs}/stat", encoding="ascii") as file:
        fields = file.readline().split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"{procfs}/stat does not start with the cpu line")
    user, nice, system, idle, iowait, irq, softirq = (
        int(value) for value in (fields[1:8] + ["0"] * 7)[:7]
    )
    busy = user + nice + system + irq + softirq
    return CpuTimes(busy / CLOCK_TICKS, (busy + idle + iowait) / CLOCK_TICKS)


def list_pids(procfs: str) -> set[int]:
    """Pids of every process (thread group) in procfs."""
    return {int(name) for name in os.listdir(procfs) if name.isdigit()}


class ProcfsSource(ProcessSource):
    """Reads utime+stime of every process each interval."""

    name = "procfs"
    cgroup_recheck = CGROUP_RECHECK

    def start(self) -> None:
        if not os.path.isfile(f"{self.config.procfs}/self/stat"):
            raise SourceAbsent(
                f"{self.config.procfs} is not a mounted procfs (no self/stat): "
                "mount the host's /proc and pass --procfs, e.g. --procfs /host/proc"
            )

    def read(self) -> SourceReading:
        procfs, now = self.config.procfs, self.table.clock()
        alive: set[int] = set()
        for pid in list_pids(procfs):
            raw = read_raw_stat(procfs, pid)
            if raw is None:
                continue
            entry = self.table.current(pid)
            if entry is not None and raw == entry.raw_stat:  # a sleeper: nothing to parse
                self.table.revive(entry)
                alive.add(pid)
            elif self._changed(pid, raw, entry, now):
                alive.add(pid)
        self.table.end_missing(alive)
        return SourceReading(processes=self.table.rows())

    def _changed(self, pid: int, raw: bytes, entry: TrackedProcess | None, now: float) -> bool:
        """Take a process's stat line that differs from the last one read; False when it cannot
        be parsed or the process is gone."""
        try:
            stat = parse_stat(pid, raw.decode(errors="replace"))
        except (ValueError, IndexError):
            return False
        if entry is None or entry.start != stat.start:
            if self.table.shut_out(pid, stat.start, stat.cpu_seconds):
                return False
            cgroup = read_raw_cgroup(self.config.procfs, pid)
            if cgroup is None:
                return False
            found = container_id(cgroup.decode(errors="replace"))
            entry = self.table.begin(pid, stat.start, stat.comm, found, stat.cpu_seconds)
            entry.raw_cgroup, entry.cgroup_due = cgroup, now + self.cgroup_recheck
        else:
            self.table.revive(entry)
            self.table.relabel(entry, stat.comm, self._container_id(entry, now))
            self.table.count(entry, stat.cpu_seconds)
        entry.raw_stat = raw
        return True

    def _container_id(self, entry: TrackedProcess, now: float) -> str:
        """The container of a process that ran: its cgroup read again where due (a cgroup move is
        followed then), parsed only when it changed."""
        if now < entry.cgroup_due:
            return entry.container_id
        entry.cgroup_due = now + self.cgroup_recheck
        cgroup = read_raw_cgroup(self.config.procfs, entry.pid)
        if cgroup is None or cgroup == entry.raw_cgroup:  # gone: its stat was the last news
            return entry.container_id
        entry.raw_cgroup = cgroup
        return container_id(cgroup.decode(errors="replace"))

    def describe(self, reading: SourceReading) -> str:
        return (
            f"{len(reading.processes)} process(es) from {self.config.procfs}/<pid>/stat; "
            "processes living less than one interval are not seen (the ebpf source sees them)"
        )
