"""The procfs source: /proc/<pid>/stat parsing, accuracy, grace, cap, a host /proc elsewhere."""

from __future__ import annotations

import operator
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_helpers import Burner, container_cgroup
from kepler_bridge.sampling.counters import MonotonicCounters
from kepler_bridge.sources.base import SourceAbsent
from kepler_bridge.sources.procfs import CLOCK_TICKS, ProcfsSource, parse_stat
from scaffold import make_config, stat_line

ID = "d" * 64


def test_parse_stat_with_spaces_and_parentheses_in_comm() -> None:
    stat = parse_stat(1234, stat_line(1234, "a (weird) name", 150, 50, 777))
    assert (stat.pid, stat.comm, stat.start) == (1234, "a (weird) name", 777)
    assert stat.cpu_seconds == pytest.approx(200 / CLOCK_TICKS)


def test_parse_real_stat() -> None:
    stat = parse_stat(1, Path("/proc/1/stat").read_text())
    assert stat.comm == Path("/proc/1/comm").read_text().strip()
    assert stat.start >= 0 and stat.cpu_seconds >= 0


def test_burn_agrees_with_proc_within_5_percent() -> None:
    source = ProcfsSource(make_config())
    source.start()
    with Burner() as burner:
        assert burner.pid in {row.pid for row in source.read().processes}
        burner.burn(1.0)
        row = next(row for row in source.read().processes if row.pid == burner.pid)
        assert row.cpu_seconds == pytest.approx(burner.cpu_seconds(), rel=0.05)
        assert row.cpu_seconds >= 0.95
        assert row.comm == Path(f"/proc/{burner.pid}/comm").read_text().strip()


def test_ended_process_kept_for_the_grace_period() -> None:
    source = ProcfsSource(make_config(process_grace="0.5s"))
    source.start()
    with Burner() as burner:
        burner.burn(0.1)
        pid = burner.pid
        last = next(row for row in source.read().processes if row.pid == pid).cpu_seconds
    row = next(row for row in source.read().processes if row.pid == pid)
    assert row.cpu_seconds == last
    time.sleep(0.5)
    assert pid not in {row.pid for row in source.read().processes}


def test_cap_bounds_the_rows() -> None:
    source = ProcfsSource(make_config(max_processes="3"))
    source.start()
    assert len(source.read().processes) == 3
    assert len(source.table) == 3


def test_reads_a_host_proc_mounted_elsewhere(tmp_path: Path) -> None:
    """With --procfs /host/proc the pids, comms and cgroups are the host's, not this container's."""
    proc = tmp_path / "host" / "proc"
    for pid, comm, cgroup in (
        (1, "systemd", "0::/init.scope\n"),
        (4321, "nginx", f"0::/kubepods.slice/cri-containerd-{ID}.scope\n"),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(stat_line(pid, comm, 300, 100, 5000))
        (proc / str(pid) / "cgroup").write_text(cgroup)
    (proc / "self").symlink_to("4321")
    source = ProcfsSource(make_config(procfs=str(proc)))
    source.start()
    rows = {row.pid: row for row in source.read().processes}
    assert rows[4321].comm == "nginx" and rows[4321].container_id == ID
    assert rows[4321].cpu_seconds == pytest.approx(400 / CLOCK_TICKS)
    assert rows[1].container_id == ""


def test_missing_procfs_is_absent(tmp_path: Path) -> None:
    with pytest.raises(SourceAbsent, match="--procfs"):
        ProcfsSource(make_config(procfs=str(tmp_path))).start()


# Reads the procfs tree argv[1] with a ProcfsSource and prints the pids it reports.
READ_PIDS = """
import sys
from kepler_bridge import config
from kepler_bridge.sources.procfs import ProcfsSource
source = ProcfsSource(config.load({"procfs": sys.argv[1]}, {}))
source.start()
print(sorted(row.pid for row in source.read().processes))
"""


def host_proc(root: Path, stats: dict[int, str]) -> Path:
    for pid, text in stats.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(text)
        (root / str(pid) / "cgroup").write_text("0::/init.scope\n")
    (root / "self").symlink_to(str(min(stats)))
    return root


def test_an_unreadable_stat_skips_that_process_only(tmp_path: Path) -> None:
    proc = host_proc(
        tmp_path / "proc",
        {
            1: stat_line(1, "init", 1, 1, 1),
            2: stat_line(2, "hidden", 5, 5, 9),
            3: stat_line(3, "also-hidden", 5, 5, 9),
        },
    )
    (proc / "2" / "stat").chmod(0)  # what hidepid=1 or an LSM answers: EACCES
    (proc / "3" / "cgroup").chmod(0)
    # Root reads any file: the reading process runs without CAP_DAC_OVERRIDE,
    # like an unprivileged agent.
    drop = (
        ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
        if os.geteuid() == 0
        else []
    )
    result = subprocess.run(
        [*drop, sys.executable, "-c", READ_PIDS, str(proc)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1]"


@given(cut=st.integers(min_value=0, max_value=len(stat_line(2, "a (b) c", 150, 50, 777)) - 1))
@settings(max_examples=60, deadline=None)
def test_a_truncated_stat_skips_that_process_only(cut: int) -> None:
    whole = stat_line(2, "a (b) c", 150, 50, 777)
    with tempfile.TemporaryDirectory() as root:
        proc = host_proc(Path(root), {1: stat_line(1, "init", 3, 1, 1), 2: whole[:cut]})
        source = ProcfsSource(make_config(procfs=str(proc)))
        source.start()
        rows = {row.pid: row for row in source.read().processes}
    assert rows[1].cpu_seconds == pytest.approx(4 / CLOCK_TICKS)
    assert set(rows) <= {1, 2}
    if 2 in rows:  # cut after the fields the agent reads
        assert (rows[2].comm, rows[2].cpu_seconds) == ("a (b) c", pytest.approx(200 / CLOCK_TICKS))


def test_a_stat_line_read_again_is_taken_only_when_it_changed(tmp_path: Path) -> None:
    """An unchanged /proc/<pid>/stat line is not parsed again; a changed counter, an exec (new
    comm), a pid reused (new start) and an exit are each seen at the next read."""
    proc = host_proc(
        tmp_path / "proc", {1: stat_line(1, "init", 3, 1, 1), 2: stat_line(2, "job", 100, 0, 50)}
    )
    source = ProcfsSource(make_config(procfs=str(proc), process_grace="0"))
    source.start()

    def rows() -> dict[int, tuple[str, float]]:
        return {
            row.pid: (row.comm, row.cpu_seconds * CLOCK_TICKS) for row in source.read().processes
        }

    def write(line: str) -> None:
        (proc / "2" / "stat").write_text(line)

    first = source.read().processes
    assert source.read().processes == first and all(
        map(operator.is_, source.read().processes, first)
    )
    write(stat_line(2, "job", 150, 10, 50))
    assert rows()[2] == ("job", pytest.approx(160))
    write(stat_line(2, "exec'd", 150, 10, 50))
    assert rows()[2] == ("exec'd", pytest.approx(160))
    write(stat_line(2, "new", 5, 0, 90))  # the pid now belongs to a process started later
    assert rows()[2] == ("new", pytest.approx(5))
    write(stat_line(2, "new", 5, 0, 90))  # the very same line again
    assert rows()[2] == ("new", pytest.approx(5))
    (proc / "2" / "stat").unlink()
    assert set(rows()) == {1}


@pytest.mark.parametrize("grace", ["30s", "0"])
def test_a_pid_taken_again_under_the_same_labels_counts_each_process_whole(
    tmp_path: Path, grace: str
) -> None:
    """A process ends and another takes its pid with the same comm and container, within the
    grace or after it, with more CPU time than the first had: the counters count both whole."""
    proc = host_proc(
        tmp_path / "proc", {1: stat_line(1, "init", 3, 1, 1), 2: stat_line(2, "job", 100, 0, 50)}
    )
    source = ProcfsSource(make_config(procfs=str(proc), process_grace=grace))
    source.start()
    counters = MonotonicCounters()

    def counted() -> float:
        increases = counters.cpu_increases(source.read().processes)
        return sum(seconds for key, seconds in increases.items() if key[0] == 2) * CLOCK_TICKS

    assert counted() == pytest.approx(100)
    (proc / "2" / "stat").unlink()  # it ended
    assert counted() == 0
    (proc / "2" / "stat").write_text(stat_line(2, "job", 140, 10, 90))  # started at tick 90
    assert counted() == pytest.approx(150)
    (proc / "2" / "stat").write_text(stat_line(2, "job", 160, 10, 90))
    assert counted() == pytest.approx(20)


def test_a_process_that_ran_follows_its_cgroup_move_once_due(tmp_path: Path) -> None:
    """A process moved to a container's cgroup is booked there at the first read after it ran
    once `cgroup_recheck` seconds passed since its cgroup was last read; not before (cheap)."""
    proc = host_proc(
        tmp_path / "proc", {1: stat_line(1, "init", 3, 1, 1), 2: stat_line(2, "job", 10, 0, 50)}
    )
    source = ProcfsSource(make_config(procfs=str(proc)))
    now = [0.0]
    source.table.clock = lambda: now[0]
    source.cgroup_recheck = 5.0
    source.start()
    ran = iter(range(11, 100))

    def container_after(seconds: float, run: bool) -> str:
        now[0] += seconds
        if run:
            (proc / "2" / "stat").write_text(stat_line(2, "job", next(ran), 0, 50))
        return {row.pid: row.container_id for row in source.read().processes}[2]

    assert container_after(0, run=False) == ""
    (proc / "2" / "cgroup").write_text(f"0::/system.slice/docker-{ID}.scope\n")  # moved
    assert container_after(10, run=False) == ""  # asleep: not read
    assert container_after(0, run=True) == ID
    (proc / "2" / "cgroup").write_text("0::/user.slice\n")  # moved out
    assert container_after(2.5, run=True) == ID  # read too lately
    assert container_after(2.5, run=True) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="moving a process between cgroups needs root")
def test_a_real_cgroup_move_is_followed() -> None:
    """What runc exec or systemd-run does to a running process: a cgroup v2 move into a
    container's cgroup and out again, each followed at the next read after it ran."""
    source = ProcfsSource(make_config())
    source.start()
    source.cgroup_recheck = 0.0

    def container_of(pid: int) -> str:
        return next(row for row in source.read().processes if row.pid == pid).container_id

    with container_cgroup("procfs-test", ID) as cgroup, Burner() as burner:
        assert container_of(burner.pid) != ID
        (cgroup / "cgroup.procs").write_text(str(burner.pid))
        burner.burn(0.05)
        assert container_of(burner.pid) == ID
        (cgroup.parent / "cgroup.procs").write_text(str(burner.pid))  # no container's
        burner.burn(0.05)
        assert container_of(burner.pid) == ""
