"""The master (kepler_bridge/http/supervisor.py): a worker that stops beating is aborted then
killed, one that cannot boot stops the agent with status 3, and SIGTERM stops both and removes
the state directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import Agent
from kepler_bridge.http import supervisor
from kepler_bridge.http.server import Heartbeat

# A stand-in worker that outlives SIGABRT, as one stuck in a driver call may.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGABRT, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_a_worker_that_stops_beating_is_aborted_then_killed(tmp_path: Path) -> None:
    master = supervisor.Supervisor([], str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        master.pid = child.pid
        master.heartbeat = supervisor._heartbeat_file(str(tmp_path))
        Heartbeat(master.heartbeat).notify()  # the worker's beat, on the master's clock
        master._check_heartbeat()
        assert child.poll() is None, "a worker that beats was killed"
        stale = time.monotonic() - supervisor.TIMEOUT_SECONDS - 1
        os.utime(master.heartbeat, (stale, stale))
        master._check_heartbeat()  # SIGABRT, which this one ignores
        time.sleep(0.2)
        assert child.poll() is None
        master._check_heartbeat()
        assert child.wait(5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    assert os.listdir(tmp_path) == [], "the heartbeat file is unlinked"


def test_the_master_sleeps_until_the_heartbeat_could_be_stale(tmp_path: Path) -> None:
    master = supervisor.Supervisor([], str(tmp_path))
    master.pid = os.getpid()
    master.heartbeat = supervisor._heartbeat_file(str(tmp_path))
    try:
        Heartbeat(master.heartbeat).notify()
        assert supervisor.TIMEOUT_SECONDS - 1 < master._until_stale() <= supervisor.TIMEOUT_SECONDS
        old = time.monotonic() - supervisor.TIMEOUT_SECONDS + 10
        os.utime(master.heartbeat, (old, old))
        assert 9 < master._until_stale() <= 10
        stale = time.monotonic() - supervisor.TIMEOUT_SECONDS - 1
        os.utime(master.heartbeat, (stale, stale))
        assert master._until_stale() == supervisor.CHECK_SECONDS  # then SIGKILL a second on
        ahead = time.monotonic() + 3600  # a heartbeat from the future waits no longer than one
        os.utime(master.heartbeat, (ahead, ahead))
        assert master._until_stale() == supervisor.TIMEOUT_SECONDS
    finally:
        os.close(master.heartbeat)


@pytest.mark.e2e
def test_an_idle_master_is_not_woken_every_second() -> None:
    """The kernel's count of the master's runs (/proc/PID/schedstat) over 4 s of a running agent
    that nobody scrapes: it waits for a signal or for the heartbeat to be able to go stale."""
    with Agent("--simulate", "1", "--sources", "simulated", "--interval", "0.5s") as agent:
        assert agent.process is not None
        runs = Path(f"/proc/{agent.process.pid}/schedstat")
        before = int(runs.read_text().split()[2])
        time.sleep(4)
        after = int(runs.read_text().split()[2])
    assert after - before <= 1


def test_a_worker_that_cannot_boot_stops_the_master_with_status_3(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "sampler-state.json").write_text("{}")
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)  # descriptors the worker finds closed: it cannot read its settings
    args = ["--listen-fd", str(closed), "--settings-fd", str(closed)]
    result = subprocess.run(
        [sys.executable, "-S", supervisor.__file__, str(state), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == supervisor.BOOT_FAILED, result.stderr
    assert "the worker cannot start" in result.stderr and "Worker failed to boot." in result.stderr
    assert not state.exists(), "the state directory outlived the master"


@pytest.mark.e2e
def test_sigterm_stops_the_worker_and_the_master_and_removes_the_state() -> None:
    with Agent("--simulate", "1", "--sources", "simulated", "--interval", "0.5s") as agent:
        assert agent.process is not None
        master = agent.process.pid
        (worker,) = agent.worker_pids()
        assert Path(f"/proc/{master}/comm").read_text().strip() == supervisor.NAME
        assert Path(f"/proc/{worker}/comm").read_text().strip() == supervisor.NAME
        states = [
            path
            for place in ("/dev/shm", os.environ.get("TMPDIR", "/tmp"))
            for path in Path(place).glob(f"kepler-bridge-{master}-*")
        ]
        assert len(states) == 1, states
        agent.stop()
        assert agent.process.returncode == 0, agent.output()
    assert not Path(f"/proc/{worker}").exists()
    assert not states[0].exists()
