"""The master (kepler_bridge/http/supervisor.py): a worker that stops beating is aborted then
killed, one that cannot boot stops the agent with status 3, and SIGTERM stops both and removes
the state directory; neither wakes every second when idle, and a worker outlives no master."""

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
from kepler_bridge.http.worker import HEARTBEAT_SECONDS

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
        master.heartbeat = supervisor._heartbeat_file()
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
    master.heartbeat = supervisor._heartbeat_file()
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
def test_an_idle_master_and_event_loop_are_not_woken_every_second() -> None:
    """The kernel's count of the runs (/proc/PID/task/TID/schedstat) of the master and of the
    worker's event loop over 4 s of a running agent that nobody scrapes: the master waits for a
    signal or for the heartbeat to be able to go stale, the loop for an event or its next beat."""
    with Agent("--simulate", "1", "--sources", "simulated", "--interval", "0.5s") as agent:
        assert agent.process is not None
        (worker,) = agent.worker_pids()
        threads = [(agent.process.pid, agent.process.pid), (worker, worker)]
        stats = [Path(f"/proc/{pid}/task/{tid}/schedstat") for pid, tid in threads]
        before = [int(stat.read_text().split()[2]) for stat in stats]
        time.sleep(4)
        after = [int(stat.read_text().split()[2]) for stat in stats]
    runs = [b - a for a, b in zip(before, after)]
    assert max(runs) <= 1, f"runs of the master and of the event loop in 4 s: {runs}"


@pytest.mark.e2e
def test_the_worker_of_a_master_killed_outright_stops_at_once() -> None:
    """SIGKILL leaves the master no time to stop its worker: the kernel sends the worker SIGTERM
    (PR_SET_PDEATHSIG), well before its next beat would find its parent gone."""
    with Agent("--simulate", "1", "--sources", "simulated", "--interval", "0.5s") as agent:
        assert agent.process is not None
        (worker,) = agent.worker_pids()
        os.kill(agent.process.pid, signal.SIGKILL)
        agent.process.wait(5)
        deadline = time.monotonic() + HEARTBEAT_SECONDS / 2
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(worker), "the worker outlived its master"


def running(pid: int) -> bool:
    """Whether the process runs: neither gone nor a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
def test_the_worker_runs_the_agent_installed_not_a_package_in_its_working_directory(
    tmp_path: Path,
) -> None:
    # A root agent started in a directory others can write (/tmp) must not run their code.
    planted = tmp_path / "kepler_bridge"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit('planted kepler_bridge imported')\n"
    )
    with Agent("--sources", "procfs", cwd=str(tmp_path)) as agent:
        (worker,) = agent.worker_pids()
        assert Path(f"/proc/{worker}/cwd").resolve() == tmp_path.resolve()
        assert agent.get("/healthz").status_code == 200
    assert not marker.exists(), "the worker imported kepler_bridge from its working directory"


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
