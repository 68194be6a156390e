"""Helpers of the CPU accounting tests: children that use a known amount of CPU, and the eBPF precondition."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kepler_bridge import kernel_headers
from kepler_bridge.sources.ebpf import tracefs_problem
from kepler_bridge.sources.ebpf_loader import BCC_DIRS
from kepler_bridge.sources.procfs import read_stat

# Burns the CPU seconds named on each stdin line (summed over argv[1] threads), then answers "done".
_BURN_ON_COMMAND = """
import sys, threading, time
def burn(end):
    while time.process_time() < end:
        pass
for line in sys.stdin:
    end = time.process_time() + float(line)
    threads = [threading.Thread(target=burn, args=(end,)) for _ in range(int(sys.argv[1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("done", flush=True)
"""

_BURN_AND_EXIT = """
import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
"""


class Burner:
    """A child that burns CPU on command; use as a context manager."""

    def __init__(self, preexec_fn=None, threads: int = 1) -> None:
        self.process = subprocess.Popen([sys.executable, "-S", "-c", _BURN_ON_COMMAND, str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        preexec_fn=preexec_fn)
        self.pid = self.process.pid

    def __enter__(self) -> "Burner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, seconds: float) -> None:
        """Begin burning `seconds` of CPU time."""
        self.process.stdin.write(f"{seconds}\n")
        self.process.stdin.flush()

    def wait(self) -> None:
        """Wait until the burn started last has finished."""
        assert self.process.stdout.readline() == "done\n"

    def burn(self, seconds: float) -> None:
        self.start(seconds)
        self.wait()

    def cpu_seconds(self) -> float:
        """utime + stime of the child, from /proc."""
        stat = read_stat("/proc", self.pid)
        assert stat is not None
        return stat.cpu_seconds

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(10)


def short_lived(seconds: float, preexec_fn=None) -> tuple[int, float]:
    """Run a child that burns `seconds` of CPU and exits; return its pid and its utime + stime (rusage)."""
    process = subprocess.Popen([sys.executable, "-S", "-c", _BURN_AND_EXIT, str(seconds)], preexec_fn=preexec_fn)
    _, _, usage = os.wait4(process.pid, 0)
    process.returncode = 0
    return process.pid, usage.ru_utime + usage.ru_stime


def bpf_missing() -> str:
    """What this machine lacks for the eBPF tests, '' when nothing."""
    if os.geteuid() != 0:
        return "not root"
    if importlib.util.find_spec("bcc") is None and not any(Path(d, "bcc", "__init__.py").is_file() for d in BCC_DIRS):
        return "bcc's Python package (python3-bpfcc) is not installed"
    if shutil.which("bpftool") is None:
        return "bpftool is not installed"
    problem = tracefs_problem()
    if problem:
        return problem
    try:
        kernel_headers.find()
    except kernel_headers.HeadersMissing as err:
        return str(err)
    return ""


def require_bpf() -> None:
    """Fail (skip only outside CI, when not root) unless the real BPF programs can load here."""
    missing = bpf_missing()
    if missing:
        if os.geteuid() != 0 and not os.environ.get("CI"):
            pytest.skip(f"{missing}: the eBPF tests need root (CI runs them as root)")
        pytest.fail(f"{missing}: run `make deps` as root (scripts/prepare-bpf-host.sh installs bcc, bpftool "
                    "and kernel headers, links them for this kernel and mounts tracefs)")
