"""Counters continue when gunicorn replaces a killed worker, through the real agent; the state
they continue from is data only, never older than what was served, and a dead master's is
removed."""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import pickle
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from agent import Agent
from cpu_helpers import require_bpf
from kepler_bridge.sampling import carry, state_file
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore
from powercap import PowercapTree
from scaffold import families, make_config, require

# Counters that count from the agent's start (or from the source's start, for the simulated GPUs):
# without the carried state a new worker would start each of them again from zero.
RESTARTING = (
    "kepler_bridge_node_cpu_joules_total",
    "kepler_bridge_pod_cpu_joules_total",
    "kepler_bridge_process_cpu_joules_total",
    "kepler_bridge_node_gpu_idle_joules_total",
    "kepler_bridge_pod_gpu_joules_total",
    "gpu_energy_joules_total",
    "kepler_bridge_process_cpu_seconds_total",
)

SIMULATED = ("--simulate", "2", "--sources", "simulated", "--interval", "0.1s")


def counters(agent: Agent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """Every counter series of the agent (not prometheus_client's process_*, which describe one
    worker process), or None while no worker answers with a sample."""
    try:
        text = agent.metrics()
    except requests.RequestException:
        return None
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families(text).values()
        if family.type == "counter" and not family.name.startswith("process_")
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def replace_worker(agent: Agent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """SIGKILL the worker (a stopped one too), wait for the master's next one and return the
    counters of its first sample."""
    (worker,) = agent.worker_pids()
    os.kill(worker, signal.SIGKILL)
    agent.wait_for(
        lambda: agent.worker_pids() not in ([], [worker]),
        what="the master to start a new worker",
    )
    return agent.wait_for(lambda: counters(agent), what="the new worker's first sample")


def state_dirs(master: int) -> list[Path]:
    return [
        path
        for place in ("/dev/shm", tempfile.gettempdir())
        for path in Path(place).glob(f"kepler-bridge-{master}-*")
    ]


@pytest.mark.e2e
def test_counters_continue_from_their_last_value_in_a_new_worker(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("intel-rapl:0", "package-0", 0)
    with (
        tree.drawing("intel-rapl:0", watts=100.0),
        Agent(
            "--simulate",
            "2",
            "--sources",
            "procfs,rapl",
            "--sysfs",
            str(tree.sysfs),
            "--interval",
            "0.25s",
            "--cpu-tdp-watts",
            "0",
        ) as agent,
    ):
        (state,) = state_dirs(agent.process.pid)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        before = agent.wait_for(
            lambda: (
                (found := counters(agent))
                and {name for (name, _), value in found.items() if value > 0} >= set(RESTARTING)
                and found
            ),
            what="every restarting counter above zero",
        )
        after = replace_worker(agent)
    assert not state_dirs(agent.process.pid), "the master left its state directory behind"
    for name in RESTARTING:
        assert any(key[0] == name for key in set(before) & set(after)), (
            f"{name} missing before or after the restart"
        )
    lower = {
        key: (value, after[key])
        for key, value in before.items()
        if key in after and after[key] < value
    }
    assert not lower, f"counters went down in the new worker: {lower}"


SAVE_ERRORS = ("kepler_bridge_state_save_errors_total", (("node", "test-node"),))
SAVE_FAILED = "cannot save counter state"


class Filler:
    """Keeps a file system full, as another program filling /dev/shm does: a block freed there is
    taken again within about a millisecond."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True)

    def __enter__(self) -> "Filler":
        self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        while self._write():
            pass
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._descriptor)

    def _write(self) -> bool:
        """Whether a block was written; False once the file system is full."""
        try:
            return os.write(self._descriptor, b"\0" * 4096) > 0
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            return False

    def _fill(self) -> None:
        while not self._stop.is_set():
            if not self._write():
                time.sleep(0.001)


@pytest.mark.e2e
def test_a_worker_is_restarted_after_its_state_directory_was_removed() -> None:
    with Agent("--simulate", "1", "--sources", "simulated", "--interval", "0.25s") as agent:
        (state,) = state_dirs(agent.process.pid)
        shutil.rmtree(state)  # as an admin cleaning /dev/shm would
        (worker,) = agent.worker_pids()
        os.kill(worker, signal.SIGKILL)
        agent.wait_for(
            lambda: agent.worker_pids() not in ([], [worker]), timeout=15, what="a new worker"
        )
        agent.wait_for(lambda: agent.get("/readyz").status_code == 200, what="ready again")
        assert agent.process.poll() is None


@pytest.mark.e2e
def test_after_a_failed_save_a_new_worker_never_goes_back_to_an_older_state() -> None:
    require(os.geteuid() == 0, "needs root: the test mounts a 64 KiB tmpfs on the state directory")
    with Agent(*SIMULATED) as agent:
        (state,) = state_dirs(agent.process.pid)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(state)], check=True
        )
        try:
            saved = state / state_file.FILE
            agent.wait_for(saved.exists, what="a save on the small file system")
            time.sleep(4)  # counters far above what a new worker counts in its first second
            filled = agent.wait_for(lambda: counters(agent), what="the counters")
            with Filler(state / "filler"):
                agent.wait_for(lambda: SAVE_FAILED in agent.output(), what="a failed save")
                agent.wait_for(lambda: not saved.exists(), what="the older state removed")
                time.sleep(1)  # what is served goes on growing
                before = agent.wait_for(lambda: counters(agent), what="the counters")
                left = [path.name for path in state.iterdir() if path.name != "filler"]
                after = replace_worker(agent)
        finally:
            subprocess.run(["umount", "--lazy", str(state)], check=True)
    assert not left, f"a failed save left {left}"
    assert before[SAVE_ERRORS] >= 3 and after[SAVE_ERRORS] >= 1
    assert agent.output().count(SAVE_FAILED) == 2, "one warning per worker, not one per failure"
    stale = {
        key: (filled[key], before[key], after[key])
        for key in set(filled) & set(after)
        if 0 < filled[key] <= after[key] < before[key]
    }
    assert not stale, f"counters went back to an older state (filled, served, after): {stale}"


class Exploit:
    """A pickle that creates a marker file when it is loaded: what a crafted state could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch '{self.marker}'",))


def idle_joules(found: dict) -> float:
    return sum(
        v for (name, _), v in found.items() if name == "kepler_bridge_node_gpu_idle_joules_total"
    )


@pytest.mark.e2e
def test_a_crafted_state_file_and_a_link_at_the_partial_path_do_nothing(tmp_path: Path) -> None:
    marker, target = tmp_path / "ran", tmp_path / "target"
    target.write_bytes(b"kept")
    with Agent(*SIMULATED) as agent:
        (state,) = state_dirs(agent.process.pid)
        saved = state / state_file.FILE
        (worker,) = agent.worker_pids()
        partial = state / f"{state_file.FILE}.{worker}"
        os.kill(worker, signal.SIGSTOP)  # between two saves, so the link is in place for the next
        partial.unlink(missing_ok=True)
        partial.symlink_to(target)
        inode = saved.stat().st_ino
        os.kill(worker, signal.SIGCONT)
        agent.wait_for(lambda: saved.stat().st_ino != inode, what="a save past the link")
        assert target.read_bytes() == b"kept", "a save wrote through the link"
        assert not partial.is_symlink()
        time.sleep(3)
        before = agent.wait_for(lambda: counters(agent), what="the counters")
        os.kill(worker, signal.SIGSTOP)  # no more saves: the crafted file is what the next reads
        saved.write_bytes(pickle.dumps(Exploit(marker)))
        after = replace_worker(agent)
    assert not marker.exists(), "loading the state ran code"
    assert agent.output().count("unreadable, counters restart from zero") == 1
    assert idle_joules(after) < idle_joules(before), "counters did not restart from zero"


@pytest.mark.e2e
def test_state_directories_of_masters_that_no_longer_run_are_removed_at_start_up() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    # Named after a pid that has ended, and after a live process that is no kepler-bridge.
    here = "".join(filter(str.isdigit, os.readlink("/proc/self/ns/pid")))
    stale = [
        Path(place, f"kepler-bridge-{pid}-{here}-left")
        for place in ("/dev/shm", tempfile.gettempdir())
        for pid in (ended.pid, os.getpid())
    ]
    for path in stale:
        path.mkdir()
        (path / state_file.FILE).write_text("{}")
    not_a_directory = Path(tempfile.gettempdir(), f"kepler-bridge-{ended.pid}-{here}-file")
    # The same ended pid in another pid namespace, where it may well be running.
    elsewhere = Path(tempfile.gettempdir(), f"kepler-bridge-{ended.pid}-1-left")
    elsewhere.mkdir()
    not_a_directory.write_text("")
    try:
        with Agent(*SIMULATED) as running:
            (kept,) = state_dirs(running.process.pid)
            with Agent(*SIMULATED):
                assert kept.exists(), "a running agent's state directory was removed"
                assert not [path for path in stale if path.exists()]
                assert not_a_directory.exists()
                assert elsewhere.exists(), "another pid namespace's directory was removed"
    finally:
        not_a_directory.unlink()
        shutil.rmtree(elsewhere, ignore_errors=True)
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)


def test_a_state_that_is_not_this_agents_is_a_clean_restart_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(simulate=2, sources="simulated", kube_source="off")
    first = Sampler(config, SnapshotStore(), state_dir=str(tmp_path))
    for _ in range(3):
        first.sample()
    first._save()
    first.stop()
    path = tmp_path / state_file.FILE
    good = path.read_text()
    assert json.loads(good)["devices"]["devices"], "the state names the devices"
    bad = {
        "truncated": good[: len(good) // 2],
        "a number as a string": good.replace('"next":2', '"next":"2"'),
        "a boolean as a number": good.replace('"save_errors":0', '"save_errors":true'),
        "a field missing": good.replace('"attribution":', '"something":'),
        "another version": good.replace('"version":1', '"version":0'),
        "not an object": "[]",
        "deeply nested": "[" * 100_000,
    }
    for what, number in (("NaN", math.nan), ("Infinity", math.inf), ("a negative", -1.0)):
        crafted = json.loads(good)
        crafted["devices"]["devices"][0][3] = number  # when the device was last seen
        bad[f"{what} as a number"] = json.dumps(crafted)  # as json.dumps writes them
    for what, text in bad.items():
        assert text != good, what
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            sampler = Sampler(config, SnapshotStore(), state_dir=str(tmp_path))
        warnings = [r for r in caplog.records if "counters restart from zero" in r.getMessage()]
        assert len(warnings) == 1, what
        assert sampler._devices.state()["devices"] == [], f"{what}: state taken over"
        sampler.stop()
    path.write_text(good)
    assert Sampler(config, SnapshotStore(), state_dir=str(tmp_path))._devices.state()["next"] == 2


def test_a_state_directory_named_after_this_masters_pid_is_a_predecessors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a restarted container the new master often has the pid of the killed one (1)."""
    monkeypatch.setattr(carry, "_agent_running", lambda pid: True)
    here = "".join(filter(str.isdigit, os.readlink("/proc/self/ns/pid")))
    own = tmp_path / f"kepler-bridge-{os.getpid()}-{here}-old"
    other = tmp_path / f"kepler-bridge-{os.getpid() + 1}-{here}-live"
    own.mkdir()
    other.mkdir()
    carry.remove_stale_dirs(str(tmp_path))
    assert not own.exists() and other.exists()


def test_a_master_caught_in_the_middle_of_execve_is_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` execs into the master: read at that moment, its command line is empty. Two agents
    starting together removed each other's state directory so (a fleet benchmark, CI)."""
    master = b"\0".join([b"python3", b"-S", b"/x/kepler_bridge/http/supervisor.py", b"/dev/shm/d"])
    reads = {"execs": [b"", master], "kernel thread": [b""] * carry.CMDLINE_READS}

    def running(what: str) -> bool:
        lines = iter(reads[what])
        monkeypatch.setattr(carry, "open", lambda *args: io.BytesIO(next(lines)), raising=False)
        return carry._agent_running(12345)

    assert running("execs")
    assert not running("kernel thread")


def test_no_place_for_the_state_is_a_warning_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_temporary_directory() -> str:
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found")

    monkeypatch.setattr(carry, "PLACES", ("/nonexistent/kepler-bridge-test", None))
    monkeypatch.setattr(tempfile, "gettempdir", no_temporary_directory)
    with caplog.at_level(logging.WARNING):
        assert carry.make_dir() == ""
    assert "no directory for counter state" in caplog.text and "$TMPDIR" in caplog.text


def test_the_state_is_never_put_where_others_could_swap_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, no sticky bit: anyone may rename what is in it
    monkeypatch.setattr(carry, "PLACES", (str(shared),))
    with caplog.at_level(logging.WARNING):
        assert carry.make_dir() == ""
    assert "lacks the sticky bit" in caplog.text and os.listdir(shared) == []
    shared.chmod(0o1777)  # as /tmp is
    made = carry.make_dir()
    assert made and Path(made).parent == shared


def test_a_worker_reading_cpu_time_by_another_source_counts_no_process_twice(
    tmp_path: Path,
) -> None:
    """eBPF that fails to load in a new worker leaves procfs in its place, which reads a process
    a few ms below eBPF: that drop must not count the process's whole life again."""
    require_bpf()
    end = time.process_time() + 1.0
    while time.process_time() < end:  # a life of at least a second of CPU to count twice
        pass
    mine = lambda sampler: next(  # noqa: E731
        total for key, total in sampler._counters._process_total.items() if key[0] == os.getpid()
    )
    settings = {"kube_source": "off", "interval": "0.2s"}
    ebpf = Sampler(
        make_config(sources="ebpf", **settings), SnapshotStore(), state_dir=str(tmp_path)
    )
    for _ in range(3):
        ebpf.sample()
    ebpf._save()
    ebpf.stop()
    counted, used = mine(ebpf), time.process_time()
    procfs = Sampler(
        make_config(sources="procfs", **settings), SnapshotStore(), state_dir=str(tmp_path)
    )
    for _ in range(3):
        procfs.sample()
    procfs.stop()
    assert mine(procfs) - counted <= time.process_time() - used + 0.05
    assert mine(procfs) >= counted
