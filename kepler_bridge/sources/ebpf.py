"""CPU time per process and container from the kernel's sched_switch tracepoint (bpf/cpu_account.c).

start() has a short-lived child (ebpf_loader) compile and attach the program
with bcc and pass back the descriptors, so bcc and LLVM never stay resident
here; read() drains the maps with bpf(2) and keeps per-process counters in a
ProcessTable. Pids are those of the initial pid namespace: --procfs must show
the host's processes (hostPID, or the host's /proc mounted at --procfs).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kepler_bridge import kernel_headers
from kepler_bridge.cgroup import CgroupIdIndex, read_container_id
from kepler_bridge.config import Config
from kepler_bridge.model import SourceReading
from kepler_bridge.process_table import ProcessTable
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable
from kepler_bridge.sources.bpf_syscall import BpfMap, possible_cpus, prog_stats
from kepler_bridge.sources.ebpf_loader import BTF_PATH
from kepler_bridge.sources.procfs import list_pids, read_stat

PROGRAM = "cpu_account.c"
LOADER = str(Path(__file__).with_name("ebpf_loader.py"))
LOAD_TIMEOUT = 120.0
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# PROC_PID_INIT_INO: the initial pid namespace, whose pids BPF helpers return.
INIT_PID_NS = "pid:[4026531836]"
SOFTIRQS = ("HI", "TIMER", "NET_TX", "NET_RX", "BLOCK", "IRQ_POLL", "TASKLET", "SCHED", "HRTIMER", "RCU")
# Capability bits: CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF.
_SYS_ADMIN, _PERFMON, _BPF = 1 << 21, 1 << 38, 1 << 39

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SLICE = struct.Struct("<QII")  # struct slice_t: start_ns, tid, tgid
_INFO = struct.Struct("<Q16s")  # struct task_info_t
_HW = struct.Struct("<QQ")  # struct hw_t
_ZERO = _U32.pack(0)


def program_path() -> str:
    """bpf/cpu_account.c from a source checkout, or as installed under <prefix>/share/kepler-bridge/bpf."""
    candidates = (Path(__file__).resolve().parents[2] / "bpf" / PROGRAM,
                  Path(sys.prefix) / "share" / "kepler-bridge" / "bpf" / PROGRAM)
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise SourceAbsent(f"the BPF program {PROGRAM} is not installed (looked at "
                       f"{', '.join(map(str, candidates))}): reinstall kepler-bridge with its bpf/ directory")


@dataclass
class LoadedProgram:
    """Descriptors handed over by the loader: programs, tracepoint attachments and maps."""

    programs: dict[str, int]
    attached: dict[str, int]
    maps: dict[str, BpfMap]
    features: dict[str, str]
    switch_program: str
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Close every descriptor: this detaches the programs once no one else holds them."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def load_program(map_entries: int, headers: kernel_headers.HeaderTree, sysfs: str = "/sys",
                 attach: str = "auto", hw_counters: str = "auto", timeout: float = LOAD_TIMEOUT) -> LoadedProgram:
    """Run the loader child and take over its descriptors; SourceUnavailable says why it failed.

    attach and hw_counters are passed to the loader (see ebpf_loader.load).
    """
    request = {"program": program_path(), "map_entries": map_entries, "cflags": list(headers.cflags),
               "attach": attach, "hw_counters": hw_counters}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, tempfile.TemporaryFile() as output:
        with theirs:
            child = subprocess.Popen([sys.executable, "-I", LOADER, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=output,
                                     stderr=subprocess.STDOUT, env={**os.environ, **headers.environ})
        try:
            ours.settimeout(timeout)
            ours.sendall(json.dumps(request).encode())
            message, fds, _, _ = socket.recv_fds(ours, 1 << 16, 64)
        except socket.timeout:
            child.kill()
            raise SourceUnavailable(f"the eBPF loader did not answer within {timeout:.0f}s "
                                    f"(compiling with headers from {headers.origin})") from None
        finally:
            child.wait()
        output.seek(0)
        diagnostics = _diagnostics(output.read().decode(errors="replace"))
    reply = json.loads(message) if message else {"error": f"the eBPF loader exited {child.returncode}"}
    if "error" in reply:
        raise SourceUnavailable(reply["error"] + (f"; bcc said: {diagnostics}" if diagnostics else "") +
                                f" (kernel headers from {headers.origin})")
    ncpus = possible_cpus(sysfs)
    return LoadedProgram({name: fds[i] for name, i in reply["programs"].items()},
                         {name: fds[i] for name, i in reply["attached"].items()},
                         {name: BpfMap(fds[i], ncpus) for name, i in reply["maps"].items()},
                         reply["features"], reply["switch_program"], list(fds))


def _diagnostics(text: str, limit: int = 8) -> str:
    """The lines of compiler/bcc output worth showing: errors first, else the tail."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "unable" in line.lower()]
    return " | ".join((errors or lines)[-limit:])


def privilege_problem(procfs: str) -> str:
    """Why this process may not load BPF programs ('' when it may)."""
    try:
        with open(f"{procfs}/self/status", encoding="ascii", errors="replace") as file:
            caps = next(int(line.split()[1], 16) for line in file if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return ""
    if caps & _SYS_ADMIN or (caps & _BPF and caps & _PERFMON):
        return ""
    return ("loading BPF programs needs root, or CAP_BPF with CAP_PERFMON (kernel 5.8+): run the agent as root "
            "(in Kubernetes: securityContext.privileged: true)")


def tracefs_problem() -> str:
    """Why classic tracepoints cannot attach ('' when tracefs is mounted)."""
    if any(os.path.isdir(f"{path}/events/sched/sched_switch") for path in TRACEFS_DIRS):
        return ""
    return ("tracefs is not mounted (no events/sched/sched_switch under /sys/kernel/tracing or "
            "/sys/kernel/debug/tracing): mount -t tracefs tracefs /sys/kernel/tracing, or in a pod mount the "
            "host's /sys/kernel/tracing (or /sys/kernel/debug) at the same path")


def pid_namespace_problem(procfs: str) -> str:
    """Why pids from BPF would not match --procfs ('' when procfs shows the initial pid namespace)."""
    try:
        namespace = os.readlink(f"{procfs}/1/ns/pid")
    except OSError:
        return ""
    if namespace == INIT_PID_NS:
        return ""
    return (f"{procfs} shows pid namespace {namespace}, but eBPF reports the host's pids: run the pod with "
            "hostPID: true, or mount the host's /proc and pass --procfs /host/proc")


class EbpfSource(Source):
    """Per-process on-CPU seconds from sched_switch, including processes that live between two samples."""

    name = "ebpf"
    # "auto": raw tracepoints where the kernel has BTF, else classic ones; "tracepoint": always classic.
    attach = "auto"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.table = ProcessTable(config.max_processes, config.process_grace)
        self.cgroups = CgroupIdIndex(config.sysfs)
        self.headers: kernel_headers.HeaderTree | None = None
        self.loaded: LoadedProgram | None = None
        self.cycles = self.instructions = 0  # node totals from perf hardware counters, where they exist

    def start(self) -> None:
        procfs = self.config.procfs
        problems = [privilege_problem(procfs), pid_namespace_problem(procfs)]
        if self.attach == "tracepoint" or not os.path.isfile(BTF_PATH):  # classic tracepoints need tracefs
            problems.append(tracefs_problem())
        for problem in problems:
            if problem:
                raise SourceUnavailable(problem)
        try:
            self.headers = kernel_headers.find(procfs=procfs)
        except kernel_headers.HeadersMissing as err:
            raise SourceUnavailable(str(err)) from None
        self.loaded = load_program(self.config.ebpf_map_entries, self.headers, self.config.sysfs, self.attach)

    def stop(self) -> None:
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None

    def read(self) -> SourceReading:
        if self.loaded is None:
            raise SourceUnavailable("the eBPF program is not loaded (start() failed or stop() ran)")
        maps = self.loaded.maps
        now_ns = time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC too
        slices = maps["slice"].lookup(_ZERO) or ()
        deltas = {_U32.unpack(key)[0]: sum(_U64.unpack(value)[0] for value in values)
                  for key, values in maps["cpu_ns"].drain()}
        infos = {_U32.unpack(key)[0]: _task_info(values[0]) for key, values in maps["task_info"].drain()}
        now = time.monotonic()
        for tgid, ns in deltas.items():
            self._account(tgid, ns / 1e9, infos.get(tgid), now)
        self.table.end_missing(list_pids(self.config.procfs))
        if "hw_count" in maps:
            for _, values in maps["hw_count"].drain():
                for value in values:
                    cycles, instructions = _HW.unpack(value)
                    self.cycles += cycles
                    self.instructions += instructions
        return SourceReading(processes=self.table.rows(self._in_flight(slices, now_ns)),
                             ebpf_programs_attached=len(self.loaded.attached))

    def _account(self, tgid: int, seconds: float, info: tuple[int, str] | None, now: float) -> None:
        """Add one interval's on-CPU time of a thread group to the process it belongs to."""
        entry = self.table.current(tgid)
        if info is None:
            info = (entry.cgroup_id, entry.bpf_comm) if entry else (0, "")
        cgroup_id, bpf_comm = info
        if entry is not None and (entry.cgroup_id, entry.bpf_comm) == info:
            entry.cpu_seconds += seconds  # the same process as before, possibly ended since
            return
        procfs = self.config.procfs
        stat = read_stat(procfs, tgid)
        if stat is None:
            if entry is not None and entry.ended_at is None:
                entry.cpu_seconds += seconds
                self.table.end(entry)
                return
            # Started and ended between two samples: only BPF saw it.
            entry = self.table.begin(tgid, None, bpf_comm, self.cgroups.container_id(cgroup_id, now), seconds)
            self.table.end(entry)
        elif entry is not None and entry.start == stat.start:
            if cgroup_id != entry.cgroup_id:
                entry.container_id = read_container_id(procfs, tgid) or entry.container_id
            entry.comm, entry.ended_at = stat.comm, None
            entry.cpu_seconds += seconds
        else:
            container_id = read_container_id(procfs, tgid)
            if container_id is None:
                container_id = self.cgroups.container_id(cgroup_id, now)
            # Counted from /proc so time used before the program was loaded is included.
            entry = self.table.begin(tgid, stat.start, stat.comm, container_id, max(stat.cpu_seconds, seconds))
        entry.cgroup_id, entry.bpf_comm = cgroup_id, bpf_comm

    def _in_flight(self, slices: tuple[bytes, ...], now_ns: int) -> dict[int, float]:
        """Seconds the tasks running right now have used since they were switched in, by tgid."""
        result: dict[int, float] = {}
        for raw in slices:
            start_ns, tid, tgid = _SLICE.unpack(raw)
            if start_ns and now_ns > start_ns and (tgid or tid):
                tgid = tgid or self._tgid_of(tid)
                if tgid:
                    result[tgid] = result.get(tgid, 0.0) + (now_ns - start_ns) / 1e9
        return result

    def _tgid_of(self, tid: int) -> int:
        """Thread group of a thread id (classic tracepoints report only the thread)."""
        entry = self.table.current(tid)
        if entry is not None and entry.ended_at is None:
            return tid  # a thread id that is a live pid is its group's leader
        try:
            with open(f"{self.config.procfs}/{tid}/status", encoding="utf-8", errors="replace") as file:
                for line in file:
                    if line.startswith("Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def describe(self, reading: SourceReading) -> str:
        if self.loaded is None:
            return "not loaded"
        parts = [f"{len(self.loaded.attached)} tracepoint(s) attached ({', '.join(sorted(self.loaded.attached))})",
                 f"sched_switch via {self.loaded.features.get('sched_switch', '?')}",
                 f"{len(reading.processes)} process(es)",
                 f"kernel headers from {self.headers.origin if self.headers else '?'}",
                 self._cost()]
        features = self.loaded.features
        if features.get("softirq") == "on" and "softirqs" in self.loaded.maps:
            counts = [0] * len(SOFTIRQS)
            for vector in range(len(SOFTIRQS)):
                for value in self.loaded.maps["softirqs"].lookup(_U32.pack(vector)) or ():
                    counts[vector] += _U64.unpack(value)[0]
            parts.append("softirqs since load: " + ", ".join(f"{name} {count}" for name, count in
                                                             zip(SOFTIRQS, counts) if count))
        else:
            parts.append(f"softirq counts {features.get('softirq', 'off')}")
        hardware = features.get("hw_counters", "off")
        if hardware == "on" and self.cycles:
            hardware += f", {self.cycles} cycles, IPC {self.instructions / self.cycles:.2f}"
        parts.append(f"hardware counters {hardware}")
        return "; ".join(parts)

    def _cost(self) -> str:
        program = self.loaded.programs.get(self.loaded.switch_program) if self.loaded else None
        if program is None:
            return "no sched_switch program"
        stats = prog_stats(program)
        if not stats.run_cnt:
            return "cost per event not measured (sysctl kernel.bpf_stats_enabled=1 to measure it)"
        return f"{stats.run_time_ns / stats.run_cnt:.0f} ns per sched_switch over {stats.run_cnt} events"


def _task_info(value: bytes) -> tuple[int, str]:
    cgroup_id, comm = _INFO.unpack(value)
    return cgroup_id, comm.split(b"\0", 1)[0].decode(errors="replace")

