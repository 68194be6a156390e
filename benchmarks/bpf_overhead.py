"""Cost of the eBPF CPU accounting: kernel ns per sched_switch, pipe ping-pong slowdown, agent RSS.

Prints one table. Targets (issue: eBPF CPU accounting): < 300 ns of BPF run time per
sched_switch (kernel.bpf_stats_enabled); < 3 % slowdown of a 200k round-trip pipe
ping-pong between two processes pinned to one CPU, with the agent running (also shown:
the classic-tracepoint path of kernels without BTF, and the floors: an empty program on
sched_switch, then one that only takes a timestamp); agent worker RSS < 80 MB with eBPF
loaded after --minutes (default 5) of process churn (100 short-lived processes a second).
Needs root, bcc, bpftool, kernel headers (make deps) and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from agent import Agent  # noqa: E402
from kepler_bridge import config, kernel_headers  # noqa: E402
from kepler_bridge.sources.bpf_syscall import prog_stats  # noqa: E402
from kepler_bridge.sources.ebpf import EbpfSource, load_program  # noqa: E402
from kepler_bridge.sources.ebpf_loader import import_bcc  # noqa: E402

STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")

PING_PONG_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* argv: round trips, cpu to pin both processes to (-1: no pinning).
   Prints the wall seconds and the CPU seconds both processes used. */
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    int cpu = atoi(argv[2]), there[2], back[2];
    char byte = 0;
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set)) return 2;
    }
    if (pipe(there) || pipe(back)) return 2;
    pid_t child = fork();
    if (child == 0) {
        for (long i = 0; i < n; i++)
            if (read(there[0], &byte, 1) != 1 || write(back[1], &byte, 1) != 1) _exit(1);
        _exit(0);
    }
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < n; i++)
        if (write(there[1], &byte, 1) != 1 || read(back[0], &byte, 1) != 1) return 1;
    clock_gettime(CLOCK_MONOTONIC, &end);
    waitpid(child, NULL, 0);
    struct rusage self, children;
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &children);
    double used = self.ru_utime.tv_sec + self.ru_stime.tv_sec + children.ru_utime.tv_sec + children.ru_stime.tv_sec +
                 (self.ru_utime.tv_usec + self.ru_stime.tv_usec + children.ru_utime.tv_usec +
                  children.ru_stime.tv_usec) / 1e6;
    printf("%.6f %.6f\n", (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9, used);
    return 0;
}
"""


def build_ping_pong(directory: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler is needed (apt-get install gcc)")
    source, binary = directory / "ping_pong.c", directory / "ping_pong"
    source.write_text(PING_PONG_C)
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True)
    return binary


def ping_pong(binary: Path, round_trips: int, cpu: int) -> tuple[float, float]:
    """Wall seconds, and CPU seconds of both processes (which other load on the machine barely moves)."""
    wall, cpu_seconds = subprocess.check_output([str(binary), str(round_trips), str(cpu)], text=True).split()
    return float(wall), float(cpu_seconds)


def ns_per_switch(binary: Path, round_trips: int, cpu: int) -> tuple[float, int]:
    """Mean BPF run time per sched_switch while a ping-pong runs, from bpftool's run_time_ns/run_cnt."""
    previous = STATS_SYSCTL.read_text().strip()
    STATS_SYSCTL.write_text("1")
    source = EbpfSource(config.load({}, {}))
    source.start()
    try:
        program_id = prog_stats(source.loaded.programs[source.loaded.switch_program]).id
        ping_pong(binary, round_trips, cpu)
        source.read()
        shown = json.loads(subprocess.check_output(["bpftool", "-j", "prog", "show", "id", str(program_id)]))
    finally:
        source.stop()
        STATS_SYSCTL.write_text(previous)
    return shown["run_time_ns"] / shown["run_cnt"], shown["run_cnt"]


def paired(binary: Path, round_trips: int, cpu: int, runs: int, loaded) -> dict[str, float]:
    """Median wall seconds without and with `loaded` (a context manager), and wall and CPU slowdowns in %.

    Each run times the ping-pong before, during and after; comparing with the
    mean of its neighbours cancels drift from other load on the machine.
    """
    samples: dict[str, list[float]] = {key: [] for key in ("wall", "wall_with", "wall_ratio", "cpu_ratio")}
    ping_pong(binary, round_trips // 10, cpu)  # warm caches and the CPU frequency
    for _ in range(runs):
        before = ping_pong(binary, round_trips, cpu)
        with loaded():
            ping_pong(binary, round_trips // 10, cpu)
            during = ping_pong(binary, round_trips, cpu)
        after = ping_pong(binary, round_trips, cpu)
        samples["wall"] += [before[0], after[0]]
        samples["wall_with"].append(during[0])
        samples["wall_ratio"].append(during[0] / ((before[0] + after[0]) / 2))
        samples["cpu_ratio"].append(during[1] / ((before[1] + after[1]) / 2))
    median = {key: statistics.median(values) for key, values in samples.items()}
    return {"wall": median["wall"], "wall_with": median["wall_with"], "wall_percent": (median["wall_ratio"] - 1) * 100,
            "cpu_percent": (median["cpu_ratio"] - 1) * 100}


@contextmanager
def agent_running() -> Iterator[None]:
    """The whole agent (gunicorn worker, sampler at 1 s) with the ebpf source up."""
    with Agent("--sources", "ebpf", "--interval", "1s", timeout=60) as agent:
        agent.wait_for(lambda: 'source="ebpf"} 1.0' in agent.metrics(), timeout=60, what="ebpf up")
        yield


@contextmanager
def bcc_program(text: str) -> Iterator[None]:
    """A tiny program loaded with bcc in this process: the floors the accounting program cannot go below."""
    bpf = import_bcc().BPF(text=text)
    try:
        yield
    finally:
        bpf.cleanup()


# The cost of merely hooking sched_switch, then of also taking one timestamp per switch.
EMPTY_RAW = "RAW_TRACEPOINT_PROBE(sched_switch) { return 0; }"
TIMESTAMP_RAW = """
BPF_PERCPU_ARRAY(last, u64, 1);
RAW_TRACEPOINT_PROBE(sched_switch)
{
    u32 zero = 0;
    u64 *ns = last.lookup(&zero);
    if (ns)
        *ns = bpf_ktime_get_ns();
    return 0;
}
"""


@contextmanager
def classic_tracepoints() -> Iterator[None]:
    """Only the BPF program, attached as classic tracepoints: the path of kernels without BTF."""
    loaded = load_program(16384, kernel_headers.find(), attach="tracepoint")
    try:
        yield
    finally:
        loaded.close()


def worker_pid(master: int) -> int:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return int(children[0])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_after(minutes: float) -> tuple[int, int, int]:
    """Worker RSS and peak (KiB) and tracked processes after `minutes` of eBPF accounting under process churn."""
    with Agent("--sources", "ebpf", "--interval", "1s", timeout=60) as agent:
        agent.wait_for(lambda: 'source="ebpf"} 1.0' in agent.metrics(), timeout=60, what="ebpf up")
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            subprocess.run(["/bin/true"])
            time.sleep(0.01)
        rows = agent.metrics().count("kepler_bridge_process_cpu_seconds_total{")
        worker = worker_pid(agent.process.pid)
        return status_kib(worker, "VmRSS"), status_kib(worker, "VmHWM"), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5, help="ping-pong runs with and without the agent")
    parser.add_argument("--cpu", type=int, default=0, help="CPU both ping-pong processes run on (-1: any)")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the agent runs before RSS is read")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: loading BPF programs and kernel.bpf_stats_enabled need it")

    with tempfile.TemporaryDirectory() as directory:
        binary = build_ping_pong(Path(directory))
        per_event, events = ns_per_switch(binary, args.round_trips, args.cpu)
        agent = paired(binary, args.round_trips, args.cpu, args.runs, agent_running)
        classic = paired(binary, args.round_trips, args.cpu, args.runs, classic_tracepoints)
        empty = paired(binary, args.round_trips, args.cpu, args.runs, lambda: bcc_program(EMPTY_RAW))
        stamp = paired(binary, args.round_trips, args.cpu, args.runs, lambda: bcc_program(TIMESTAMP_RAW))
    rss, peak, rows = rss_after(args.minutes)

    pairs = f"median of {args.runs} paired runs"
    print(f"{'measure':48} {'value':>12}  target")
    print(f"{'BPF run time per sched_switch':48} {per_event:>9.0f} ns  < 300 ns  ({events} events)")
    print(f"{'ping-pong ' + str(args.round_trips) + ' round trips, no agent':48} {agent['wall']:>10.3f} s")
    print(f"{'ping-pong with the agent (eBPF)':48} {agent['wall_with']:>10.3f} s")
    print(f"{'slowdown, wall clock':48} {agent['wall_percent']:>10.2f} %  < 3 %     ({pairs})")
    print(f"{'slowdown, CPU time of the two processes':48} {agent['cpu_percent']:>10.2f} %  < 3 %     ({pairs})")
    print(f"{'slowdown, classic tracepoints (no BTF), wall':48} {classic['wall_percent']:>10.2f} %")
    print(f"{'slowdown, classic tracepoints (no BTF), CPU':48} {classic['cpu_percent']:>10.2f} %")
    print(f"{'floor: empty raw sched_switch program, CPU':48} {empty['cpu_percent']:>10.2f} %")
    print(f"{'floor: + bpf_ktime_get_ns() per switch, CPU':48} {stamp['cpu_percent']:>10.2f} %")
    print(f"{'agent worker RSS after ' + f'{args.minutes:g}' + ' min, eBPF loaded':48} {rss / 1024:>8.1f} MiB  "
          f"< 80 MB    (peak {peak / 1024:.1f} MiB, {rows} process series)")

if __name__ == "__main__":
    main()
