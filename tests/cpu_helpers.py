"""Helpers of the CPU accounting tests: children that use a known amount of CPU,
and the eBPF precondition."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from kepler_bridge.sources.ebpf import kernel_headers
from kepler_bridge.sources.ebpf.loader import BCC_DIRS
from kepler_bridge.sources.ebpf.source import btf_problem
from kepler_bridge.sources.procfs import read_stat
from scaffold import require

# Burns the CPU seconds named on each stdin line (summed over argv[1] threads), then answers "done"
# and the process's own CPU time (CLOCK_PROCESS_CPUTIME_ID: every thread's runtime in ns, ended
# threads included).
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
    print("done", time.process_time(), flush=True)
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
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-c", _BURN_ON_COMMAND, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        self.pid = self.process.pid
        self.own_cpu_seconds = 0.0

    def __enter__(self) -> "Burner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, seconds: float) -> None:
        """Begin burning `seconds` of CPU time."""
        self.process.stdin.write(f"{seconds}\n")
        self.process.stdin.flush()

    def wait(self) -> None:
        """Wait until the burn started last has finished;
        own_cpu_seconds is then the child's CPU time."""
        answer, own = self.process.stdout.readline().split()
        assert answer == "done"
        self.own_cpu_seconds = float(own)

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
    """Run a child that burns `seconds` of CPU and exits; return its pid and its utime + stime
    (rusage)."""
    process = subprocess.Popen(
        [sys.executable, "-S", "-c", _BURN_AND_EXIT, str(seconds)], preexec_fn=preexec_fn
    )
    _, _, usage = os.wait4(process.pid, 0)
    process.returncode = 0
    return process.pid, usage.ru_utime + usage.ru_stime


# UDP datagrams to a socket on 127.0.0.1 that never reads: each one is a NET_RX softirq,
# then a drop. Stops by itself after argv[1] seconds or argv[2] datagrams.
_LOOPBACK_FLOOD = """
import socket, sys, time
sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sink.bind(("127.0.0.1", 0))
source = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
deadline, left = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
address, payload = sink.getsockname(), b"x" * 64
while left > 0 and time.monotonic() < deadline:
    for _ in range(1000):
        source.sendto(payload, address)
    left -= 1000
"""


def net_rx_softirqs() -> int:
    """NET_RX softirqs run so far, all CPUs (/proc/softirqs)."""
    for line in Path("/proc/softirqs").read_text().splitlines():
        if line.split(":")[0].strip() == "NET_RX":
            return sum(int(count) for count in line.split()[1:])
    raise AssertionError("no NET_RX line in /proc/softirqs")


@contextlib.contextmanager
def loopback_flood(seconds: float, datagrams: int = 50_000_000) -> Iterator[None]:
    """One loopback UDP flood per CPU while the block runs,
    each stopping by itself after `seconds` at most."""
    floods = [
        subprocess.Popen(
            [sys.executable, "-S", "-c", _LOOPBACK_FLOOD, str(seconds), str(datagrams)]
        )
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for flood in floods:
            flood.terminate()
            flood.wait(10)


@contextlib.contextmanager
def container_cgroup(tag: str, container_id: str) -> Iterator[Path]:
    """A cgroup v2 directory named like a CRI-O container, under a parent unique to this run;
    removed on exit."""
    unified = next(
        (
            root
            for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
            if (root / "cgroup.controllers").exists()
        ),
        None,
    )
    assert unified is not None, "no cgroup v2 hierarchy mounted"
    cgroup = unified / f"kepler-bridge-{tag}-{uuid.uuid4().hex[:12]}" / f"crio-{container_id}.scope"
    cgroup.mkdir(parents=True)
    try:
        yield cgroup
    finally:
        cgroup.rmdir()
        cgroup.parent.rmdir()


def bpf_missing() -> str:
    """What this machine lacks for the eBPF tests, '' when nothing."""
    if os.geteuid() != 0:
        return "not root"
    if importlib.util.find_spec("bcc") is None and not any(
        Path(d, "bcc", "__init__.py").is_file() for d in BCC_DIRS
    ):
        return "bcc's Python package (python3-bpfcc) is not installed"
    if shutil.which("bpftool") is None:
        return "bpftool is not installed"
    problem = btf_problem()
    if problem:
        return problem
    try:
        kernel_headers.find()
    except kernel_headers.HeadersMissing as err:
        return str(err)
    return ""


def require_bpf() -> None:
    """Fail unless the real BPF programs can load here (not being root is a `require`)."""
    require(os.geteuid() == 0, "not root: the eBPF tests need root")
    missing = bpf_missing()
    if missing:
        pytest.fail(
            f"{missing}: run `make deps` as root (scripts/prepare-bpf-host.sh installs bcc, "
            "bpftool and kernel headers and links them for this kernel)"
        )
