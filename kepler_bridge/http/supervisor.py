"""The agent's master: keeps one worker process running, and nothing else.

`kepler-bridge serve` validates the settings, binds the listen socket, makes the state directory,
then replaces itself (exec, same pid) by this script, run as `python -S supervisor.py`: the
standard library only, none of the settings, gunicorn or the agent's modules, so the master holds
a few MiB of its own instead of a copy of every page of the worker's modules that the worker
touched after a fork. The worker is a new interpreter (`python -m kepler_bridge.http.server`),
started again if it dies or misses its heartbeat for TIMEOUT_SECONDS; SIGHUP is passed on to it,
SIGTERM stops it (GRACEFUL_SECONDS, then SIGKILL) and the master, which removes the state
directory as it exits.
"""

from __future__ import annotations

import os
import select
import sys
import time

# Not typing's: importing typing costs the master 1.6 MiB (mypy takes any TYPE_CHECKING as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
else:  # signal's functions without the enum module signal imports: 0.8 MiB more
    import _signal as signal

TIMEOUT_SECONDS = 60  # a worker that has not beaten for this long is killed and started again
GRACEFUL_SECONDS = 1  # what a stopping worker gets before SIGKILL
CHECK_SECONDS = 1.0  # the least time between two looks at the heartbeat (SIGABRT, then SIGKILL)
BOOT_FAILED = 3  # the worker's exit status when it could not start: the master gives up with it
RESPAWN_SECONDS = 1.0  # the least time between two starts of a worker
WORKER_MODULE = "kepler_bridge.http.server"
NAME = "kepler-bridge"
STOPS: dict[int, int] = {  # what stops the master -> what it sends the worker
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGQUIT,
    signal.SIGQUIT: signal.SIGQUIT,
}


def say(level: str, message: str) -> None:
    """One log line, as the worker's gunicorn logger writes them."""
    stamp = time.strftime("[%Y-%m-%d %H:%M:%S %z]")
    sys.stderr.write(f"{stamp} [{os.getpid()}] [{level}] {message}\n")
    sys.stderr.flush()


def name_process() -> None:
    """Show as kepler-bridge (ps, top), not as the interpreter."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(NAME)
    except OSError:
        pass


class Supervisor:
    """One worker: started, watched, restarted, passed SIGHUP, stopped."""

    def __init__(self, worker_args: list[str], state_dir: str) -> None:
        self.worker_args = worker_args
        self.state_dir = state_dir
        self.pid = 0  # the running worker's, 0 when none
        self.heartbeat = -1
        self.aborted = False
        self.started_at = 0.0
        self.wake_r = self.wake_w = -1

    def run(self) -> int:
        """Keep the worker running until a stop signal or a worker that cannot start."""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        for caught in (signal.SIGCHLD, signal.SIGHUP, *STOPS):
            signal.signal(caught, lambda *_: None)  # only to wake select through the pipe
            signal.siginterrupt(caught, False)
        while True:
            if not self.pid:
                self._spawn()
            readable, _, _ = select.select([self.wake_r], [], [], self._until_stale())
            for signum in os.read(self.wake_r, 64) if readable else b"":
                if signum == signal.SIGHUP and self.pid:
                    say("INFO", "SIGHUP: the worker re-reads its settings")
                    self._kill(signal.SIGHUP)
                elif signum in STOPS:
                    say("INFO", f"Handling signal: {signal.strsignal(signum)}")
                    return self._stop(STOPS[signum], 0)
            status = self._reap()
            if status == BOOT_FAILED:
                say("ERROR", "Worker failed to boot.")
                return self._stop(signal.SIGTERM, BOOT_FAILED)
            self._check_heartbeat()

    def _spawn(self) -> None:
        wait = self.started_at + RESPAWN_SECONDS - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.started_at = time.monotonic()
        if self.heartbeat >= 0:
            os.close(self.heartbeat)
        self.heartbeat = _heartbeat_file()
        os.utime(self.heartbeat, (time.monotonic(), time.monotonic()))
        self.aborted = False
        # -P: `-m` would put the working directory first on the worker's path, and a root agent
        # started in one others write (/tmp) would run their kepler_bridge.
        args = [sys.executable, "-P", "-m", WORKER_MODULE, *self.worker_args]
        args += ["--heartbeat-fd", str(self.heartbeat), "--state-dir", self.state_dir]
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the worker handles it
                os.close(self.wake_r)
                os.close(self.wake_w)
                os.set_inheritable(self.heartbeat, True)
                os.execv(sys.executable, args)
            finally:
                os._exit(127)
        self.pid = pid

    def _reap(self) -> int | None:
        """Collect exited children; the worker's exit status when it was the worker."""
        found = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return found
            if pid == 0:
                return found
            if pid == self.pid:
                self.pid = 0
                found = os.waitstatus_to_exitcode(status)
                if found < 0:
                    say("ERROR", f"Worker (pid:{pid}) was killed: {signal.strsignal(-found)}")
                elif found:
                    say("ERROR", f"Worker (pid:{pid}) exited with code {found}")

    def _until_stale(self) -> float:
        """Seconds until the worker's heartbeat could be TIMEOUT_SECONDS old, from CHECK_SECONDS
        to TIMEOUT_SECONDS: the master sleeps that long unless a signal (a worker's exit among
        them) wakes it, instead of waking every second to look."""
        if not self.pid:
            return CHECK_SECONDS
        return min(max(TIMEOUT_SECONDS - self._heartbeat_age(), CHECK_SECONDS), TIMEOUT_SECONDS)

    def _heartbeat_age(self) -> float:
        """Seconds since the worker last beat (it sets the file's time to the monotonic clock)."""
        return time.monotonic() - os.fstat(self.heartbeat).st_mtime

    def _check_heartbeat(self) -> None:
        """Kill a worker that stopped beating: SIGABRT first (its stack in the log), then KILL."""
        if not self.pid or self._heartbeat_age() <= TIMEOUT_SECONDS:
            return
        say("CRITICAL", f"WORKER TIMEOUT (pid:{self.pid})")
        self._kill(signal.SIGKILL if self.aborted else signal.SIGABRT)
        self.aborted = True

    def _kill(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def _stop(self, signum: int, status: int) -> int:
        """Stop the worker (`signum`, then SIGKILL after GRACEFUL_SECONDS) and return `status`."""
        if self.pid:
            self._kill(signum)
            deadline = time.monotonic() + GRACEFUL_SECONDS
            while self.pid and time.monotonic() < deadline:
                time.sleep(0.05)
                self._reap()
            if self.pid:
                self._kill(signal.SIGKILL)
                os.waitpid(self.pid, 0)
        say("INFO", "Shutting down: Master")
        _remove(self.state_dir)
        return status


def _heartbeat_file() -> int:
    """A memory file whose modification time the worker sets to its monotonic clock: no file
    system, so neither a state directory removed meanwhile nor a full one stops a restart."""
    return os.memfd_create("kepler-bridge-heartbeat", 0)


def _remove(directory: str) -> None:
    """Delete the state directory: the worker's files, none of them a directory."""
    if not directory:
        return
    try:
        for entry in os.scandir(directory):
            os.unlink(entry.path)
        os.rmdir(directory)
    except OSError as err:
        say("WARNING", f"cannot remove {directory}: {err}")


def main(argv: list[str]) -> int:
    """argv: the state directory (or ''), then the worker's arguments."""
    name_process()
    return Supervisor(argv[1:], argv[0]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
