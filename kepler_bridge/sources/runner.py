"""Runs an external program for a source: no shell, a time limit, a cap on what it may print."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from kepler_bridge.printable import printable
from kepler_bridge.sources import containment

MAX_OUTPUT_BYTES = 1 << 20
STDERR_KEPT_BYTES = 4096
READ_CHUNK = 65536
EXIT_POLL_SECONDS = 0.005


class CommandFailed(Exception):
    """The program could not start, ran too long, printed too much or exited non-zero; the
    message says which."""


def run(argv: Sequence[str], timeout: float, max_bytes: int = MAX_OUTPUT_BYTES) -> str:
    """Run argv and return its stdout; raise CommandFailed otherwise. Whatever it started dies
    with it."""
    program = Path(argv[0]).name
    with containment.Run() as contained:
        try:
            # A session of its own too: its process group is killed even where no cgroup can hold
            # it.
            process = contained.start(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            raise CommandFailed(
                f"cannot run {argv[0]}: {err.strerror or err}; check the path and its permissions"
            ) from None
        assert process.stdout is not None and process.stderr is not None  # piped above
        with process.stdout, process.stderr:
            stdout, stderr = _collect(
                process, program, time.monotonic() + timeout, timeout, max_bytes
            )
    if process.returncode < 0:
        raise CommandFailed(f"{program} was killed by {_signal_name(-process.returncode)}")
    if process.returncode:
        lines = printable(stderr.decode(errors="replace"), lines=True).strip().splitlines()
        raise CommandFailed(
            f"{program} exited with status {process.returncode}: "
            f"{lines[-1] if lines else 'nothing on stderr'}"
        )
    return stdout.decode(errors="replace")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name
        return f"signal {number}"


def _collect(
    process: subprocess.Popen, program: str, deadline: float, timeout: float, max_bytes: int
) -> tuple[bytes, bytes]:
    assert process.stdout is not None and process.stderr is not None  # piped by run()
    stdout, stderr = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, stdout)
        selector.register(process.stderr, selectors.EVENT_READ, stderr)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandFailed(
                    f"{program} did not finish within {timeout:g}s (--command-timeout) and was "
                    "killed; make it faster or raise the timeout"
                )
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(stdout) > max_bytes:
                    raise CommandFailed(
                        f"{program} printed more than {max_bytes} bytes and was stopped; print "
                        "only the readings"
                    )
                del stderr[:-STDERR_KEPT_BYTES]
    # Wait without reaping: until the run ends and reaps it, its pid (its group id) cannot be
    # reused.
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            raise CommandFailed(
                f"{program} closed its output but did not exit within {timeout:g}s "
                "(--command-timeout) and was killed"
            )
        time.sleep(EXIT_POLL_SECONDS)
    return bytes(stdout), bytes(stderr)
