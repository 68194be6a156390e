"""Nothing a command starts outlives its run, not even a child that left its group with setsid().

Where the agent can create a cgroup v2 below its own, each run gets a transient one that the
program enters before exec; `cgroup.kill` then ends everything in it, and the cgroup is removed.
Elsewhere (read-only cgroupfs, cgroup v1 only, kernels before 5.14) the agent is a child
subreaper: orphans of the run are re-parented to it instead of init, and those carrying the run's
mark in their environment are killed.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from kepler_bridge.sources.cgroup import cgroup2_root
from kepler_bridge.turns import normal_children

log = logging.getLogger(__name__)

MARK_VARIABLE = "KEPLER_BRIDGE_RUN"
CGROUP_PREFIX = "kepler-bridge-run-"
END_SECONDS = 2.0  # how long killed processes may take to die before the run gives up on them
POLL_SECONDS = 0.002
PR_SET_CHILD_SUBREAPER = 36

_lock = threading.Lock()
_cgroups_usable = True
_stale_checked = False
_leftovers: list[str] = []  # cgroups whose processes did not die in time; removed by a later run
_running: set[int] = set()  # pids of programs being run, which their own Popen reaps
_active: set[Run] = set()


class Run:
    """One run of a program: start() it; end(), or leaving the `with` block, kills and reaps all
    it started."""

    def __init__(self) -> None:
        self.mark = secrets.token_hex(8)
        self.cgroup = _new_cgroup() if _cgroups_usable else ""
        self.process: subprocess.Popen | None = None
        with _lock:
            _active.add(self)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def start(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """subprocess.Popen(argv, **popen) with the run's mark in its environment, inside the run's
        cgroup."""
        env = {**os.environ, MARK_VARIABLE: self.mark}
        if self.cgroup:
            self.process = self._start_in_cgroup(argv, env, popen)
        if self.process is None:
            _become_subreaper()
            with normal_children():
                self.process = subprocess.Popen(argv, env=env, **popen)
        with _lock:
            _running.add(self.process.pid)
        return self.process

    def _start_in_cgroup(
        self, argv: Sequence[str], env: dict[str, str], popen: dict[str, Any]
    ) -> subprocess.Popen | None:
        """The program started inside the cgroup; None (and the cgroup gone) when it cannot
        enter it."""
        try:
            procs = os.open(f"{self.cgroup}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as err:
            self._without_cgroup(f"cannot open {self.cgroup}/cgroup.procs: {err.strerror}")
            return None
        try:
            # The only code the child runs before exec: one write(2) to a descriptor opened here,
            # which is what makes preexec_fn safe in a threaded agent (it takes no lock another
            # thread could hold).
            with normal_children():
                return subprocess.Popen(
                    argv, env=env, preexec_fn=lambda: os.write(procs, b"0"), **popen
                )
        except subprocess.SubprocessError:
            # The write failed in the child, which then did not run the program.
            self._without_cgroup(f"cannot move a process into {self.cgroup}")
            return None
        finally:
            os.close(procs)

    def _without_cgroup(self, reason: str) -> None:
        _give_up_cgroups(reason)
        _remove(self.cgroup)
        self.cgroup = ""

    def end(self) -> None:
        """Kill the program's process group and everything else it started, reap the program,
        clean up."""
        process = self.process
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.cgroup:
                _write(f"{self.cgroup}/cgroup.kill", "1")
            process.wait()
            with _lock:
                _running.discard(process.pid)
        if self.cgroup:
            _drain(self.cgroup)
        elif process is not None:
            self._sweep()
        with _lock:
            _active.discard(self)

    def _sweep(self) -> None:
        """Kill and reap the run's orphans re-parented to the agent, and the orphans of each
        killed one."""
        deadline = time.monotonic() + END_SECONDS
        while time.monotonic() < deadline:
            children = _children()
            marked = [pid for pid in children if _carries(pid, self.mark)]
            for pid in marked:
                _kill(pid)
            for pid in marked:
                _reap(pid, deadline)
            _reap_orphaned_zombies(children)
            if not marked:
                return


@atexit.register
def _end_all() -> None:
    """A worker stopped in the middle of a run ends it, so that neither its processes nor its
    cgroup stay."""
    with _lock:
        runs = list(_active)
    for run in runs:
        run.end()


def _new_cgroup() -> str:
    """A new empty cgroup v2 below the agent's own, '' where none can be made."""
    global _stale_checked
    root = cgroup2_root("/sys")
    own = _own_cgroup()
    if not root or own is None:
        _give_up_cgroups("no cgroup v2 hierarchy is mounted at /sys/fs/cgroup")
        return ""
    if not _stale_checked:
        _stale_checked = True
        _end_stale(root + own)
    with _lock:
        _leftovers[:] = [leftover for leftover in _leftovers if not _remove(leftover)]
    path = os.path.join(root + own, f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
    except OSError as err:
        _give_up_cgroups(f"cannot create {path}: {err.strerror}")
        return ""
    if not os.path.exists(f"{path}/cgroup.kill"):
        _remove(path)
        _give_up_cgroups("the kernel has no cgroup.kill (Linux 5.14)")
        return ""
    return path


def _end_stale(parent: str) -> None:
    """Kill what is left in the run cgroups of agents that died during a run (their pid is in
    the name)."""
    try:
        entries = [entry for entry in os.scandir(parent) if entry.name.startswith(CGROUP_PREFIX)]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(CGROUP_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _write(f"{entry.path}/cgroup.kill", "1")
            with _lock:
                _leftovers.append(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _own_cgroup() -> str | None:
    """The agent's cgroup v2 path (the `0::` line of /proc/self/cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:].rstrip("/") for line in lines if line.startswith("0::/")), None)


def _give_up_cgroups(reason: str) -> None:
    global _cgroups_usable
    if _cgroups_usable:
        _cgroups_usable = False
        log.info(
            "commands run without a cgroup of their own (%s): their orphans are killed by their "
            "mark in the environment instead, which a child that clears its environment escapes",
            reason,
        )


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError as err:
        log.warning("cannot write %s: %s", path, err)


def _drain(path: str) -> None:
    """Wait until the cgroup is empty, then remove it; one that stays populated is retried by a
    later run."""
    deadline = time.monotonic() + END_SECONDS
    while "populated 1" in _read(f"{path}/cgroup.events") and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    if not _remove(path):
        log.warning(
            "processes of a command did not die within %gs of SIGKILL (uninterruptible sleep in a "
            "driver?); %s is removed once they do",
            END_SECONDS,
            path,
        )
        with _lock:
            _leftovers.append(path)


def _remove(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _become_subreaper() -> None:
    # Every time: the flag is the process's, and a forked gunicorn worker does not inherit it.
    if _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_CHILD_SUBREAPER): %s; children that leave a command's process group "
            "survive its timeout",
            os.strerror(ctypes.get_errno()),
        )


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _children() -> list[int]:
    """The agent's child processes, from every thread (orphans are re-parented to any of them)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        pids.extend(int(pid) for pid in _read(f"{task}/children").split())
    return pids


def _carries(pid: int, mark: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"{MARK_VARIABLE}={mark}".encode() in file.read().split(b"\0")
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int, deadline: float) -> None:
    while True:
        try:
            if (
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG) is not None
                or time.monotonic() >= deadline
            ):
                return
        except ChildProcessError:
            return
        time.sleep(POLL_SECONDS)


def _reap_orphaned_zombies(children: list[int]) -> None:
    """Reap dead orphans of earlier runs. Only a command's descendants have a session other than
    the agent's (commands run in a session of their own), and no Popen waits for them."""
    session = os.getsid(0)
    with _lock:
        running = set(_running)
    for pid in children:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[3]) != session and pid not in running:
            _reap(pid, 0.0)
