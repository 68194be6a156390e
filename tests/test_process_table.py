"""ProcessTable: pid reuse, the grace period for ended processes, the cap, monotonic counters."""

from __future__ import annotations

import random

from kepler_bridge.model import ProcessCpu
from kepler_bridge.sources.process_table import ProcessTable, TrackedProcess


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def by_pid(rows: tuple[ProcessCpu, ...]) -> dict[int, ProcessCpu]:
    return {row.pid: row for row in rows}


def test_live_process_reported_with_its_labels() -> None:
    table = ProcessTable(max_processes=10, grace=30, clock=Clock())
    table.begin(42, 100, "nginx", "c" * 64, 1.5)
    assert table.rows() == (ProcessCpu(42, "nginx", 1.5, "c" * 64),)


def test_ended_process_kept_for_grace_then_dropped() -> None:
    clock = Clock()
    table = ProcessTable(max_processes=10, grace=30, clock=clock)
    table.begin(42, 100, "job", "", 2.0)
    table.begin(43, 100, "daemon", "", 1.0)
    table.end_missing(alive={43})
    clock.now += 29
    assert set(by_pid(table.rows())) == {42, 43}
    assert by_pid(table.rows())[42].cpu_seconds == 2.0
    clock.now += 1
    assert set(by_pid(table.rows())) == {43}
    assert len(table) == 1


def test_zero_grace_drops_at_the_next_sample() -> None:
    table = ProcessTable(max_processes=10, grace=0, clock=Clock())
    table.begin(42, 100, "job", "", 2.0)
    table.end_missing(alive=set())
    assert table.rows() == ()


def test_pid_reuse_is_a_new_process() -> None:
    clock = Clock()
    table = ProcessTable(max_processes=10, grace=30, clock=clock)
    old = table.begin(42, 100, "sh", "", 5.0)
    new = table.begin(42, 900, "sh", "", 0.25)
    assert old.ended_at == clock.now and new.ended_at is None
    assert table.current(42) is new
    # Same labels: only the newer process is reported (Prometheus sees a counter reset).
    assert table.rows() == (ProcessCpu(42, "sh", 0.25, ""),)


def test_pid_reuse_with_other_labels_keeps_both_during_grace() -> None:
    table = ProcessTable(max_processes=10, grace=30, clock=Clock())
    table.begin(42, 100, "sh", "", 5.0)
    table.begin(42, 900, "python", "", 0.25)
    assert sorted((row.comm, row.cpu_seconds) for row in table.rows()) == [
        ("python", 0.25),
        ("sh", 5.0),
    ]


def test_process_reported_after_a_newer_one_with_its_pid_leaves_the_newer_current() -> None:
    """The ebpf source learns of an ended process after the sample: its pid may be taken again."""
    clock = Clock()
    table = ProcessTable(max_processes=10, grace=30, clock=clock)
    new = table.begin(7, 900, "b", "", 0.2)
    old = table.begin(7, 100, "a", "", 0.1)
    table.end(old)
    assert table.current(7) is new and new.ended_at is None
    assert table.find(7, 100) is old and table.find(7, 900) is new and table.find(7, 500) is None
    assert sorted(row.comm for row in table.rows()) == ["a", "b"]
    # Same labels: the newer process is reported whatever the order they were learnt in.
    table.begin(8, 900, "c", "", 0.5)
    table.end(table.begin(8, 100, "c", "", 3.0))
    assert by_pid(table.rows())[8].cpu_seconds == 0.5


def test_cap_keeps_the_biggest_consumers() -> None:
    table = ProcessTable(max_processes=3, grace=30, clock=Clock())
    for pid, seconds in ((1, 0.1), (2, 9.0), (3, 0.2), (4, 5.0), (5, 7.0)):
        table.begin(pid, pid, f"p{pid}", "", seconds)
    assert set(by_pid(table.rows())) == {2, 4, 5}
    assert len(table) == 3
    assert table.current(1) is None


def test_cap_keeps_its_processes_when_the_evicted_come_back_no_bigger() -> None:
    """Idle processes above the cap: each sample the source reads the evicted ones again as new
    (as procfs and eBPF do); they go again, and the kept ones stay, the same rows every sample."""
    table = ProcessTable(max_processes=3, grace=30, clock=Clock())
    begun = []
    for _ in range(4):
        for pid in range(1, 6):
            entry = table.current(pid)
            if entry is None:
                begun.append(pid)
                table.begin(pid, pid, f"p{pid}", "", 1.0)
            else:
                table.count(entry, 1.0)
        kept = table.rows()
        assert set(by_pid(kept)) == {1, 2, 3}  # the first seen, at equal CPU seconds
        assert sorted(table.evicted) == [4, 5]
    assert begun == [1, 2, 3, 4, 5] + [4, 5] * 3  # only the evicted are read again as new


def test_cap_reads_an_evicted_process_again_only_once_it_ran_past_those_kept() -> None:
    """The sources ask `shut_out` before reading a process anew: an evicted one no bigger than
    the least kept is neither read nor begun again; once it ran past that, it comes back whole."""
    table = ProcessTable(max_processes=3, grace=30, clock=Clock())
    seconds = {pid: float(pid) for pid in range(1, 6)}
    begun = []
    for sample in range(5):
        if sample == 3:
            seconds[1] = 4.5  # ran: past the least kept (3.0)
        for pid, used in seconds.items():
            entry = table.current(pid)
            if entry is not None:
                table.count(entry, used)
            elif not table.shut_out(pid, pid, used):
                begun.append(pid)
                table.begin(pid, pid, f"p{pid}", "", used)
        kept = set(by_pid(table.rows()))
        assert kept == ({1, 4, 5} if sample >= 3 else {3, 4, 5})
    assert begun == [1, 2, 3, 4, 5, 1]


def test_cap_zero_means_no_cap() -> None:
    table = ProcessTable(max_processes=0, grace=30, clock=Clock())
    for pid in range(1, 101):
        table.begin(pid, pid, "p", "", pid / 10)
    assert len(table.rows()) == 100


def test_counter_never_decreases() -> None:
    table = ProcessTable(max_processes=10, grace=30, clock=Clock())
    entry = table.begin(42, 100, "burn", "", 1.5)
    assert by_pid(table.rows())[42].cpu_seconds == 1.5
    table.count(entry, 1.4)
    assert by_pid(table.rows())[42].cpu_seconds == 1.5
    table.count(entry, 1.7)
    assert by_pid(table.rows())[42].cpu_seconds == 1.7


def _reference_rows(table: ProcessTable) -> tuple[ProcessCpu, ...]:
    """The rule, computed afresh from every entry: one row per labels, the newest process's."""
    newest: dict[tuple[int, str, str], TrackedProcess] = {}
    for entry in table._entries.values():
        labels = (entry.pid, entry.comm, entry.container_id)
        if labels not in newest or newest[labels].start < entry.start:
            newest[labels] = entry
    return tuple(ProcessCpu(e.pid, e.comm, e.cpu_seconds, e.container_id) for e in newest.values())


def test_rows_kept_from_the_last_sample_match_rows_made_afresh() -> None:
    """Only the processes that changed get new rows; the rows, in their order, stay those of the
    rule over every process (pid reuse, exec, ends, the cap and the grace period mixed)."""
    rng = random.Random(18)
    clock = Clock()
    table = ProcessTable(max_processes=40, grace=3, clock=clock)
    for _ in range(300):
        for _ in range(rng.randrange(8)):
            pid = rng.randrange(60)
            entry = table.current(pid)
            action = rng.random()
            if entry is None or action < 0.2:
                start = (entry.start + rng.randrange(1, 3)) if entry else rng.randrange(50)
                table.begin(pid, start, rng.choice("ab"), rng.choice(("", "c" * 64)), rng.random())
            elif action < 0.6:
                table.count(entry, entry.cpu_seconds + rng.choice((0.0, -0.1, 0.3)))
            elif action < 0.8:
                table.relabel(entry, rng.choice("ab"), entry.container_id)
            elif action < 0.9:
                table.end(entry)
            else:
                table.revive(entry)
        if rng.random() < 0.1:
            table.end_missing(alive=set(rng.sample(range(60), 50)))
        clock.now += rng.choice((0.5, 1.0))
        rows = table.rows()
        assert rows == _reference_rows(table)
        ended = [e.ended_at for e in table._entries.values() if e.ended_at is not None]
        assert all(clock.now - at < 3 for at in ended)  # none kept past the grace period
