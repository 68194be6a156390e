"""CPU time per process and container from the kernel's own runtime counters, read with eBPF
(bpf/cpu_account.c).

start() has a short-lived child (loader.py) compile and load the programs
with bcc and pass back the descriptors, so bcc and LLVM never stay resident
here. Each read() drains the groups that ended since the last one (their final
runtime, recorded at sched_process_free), then runs one pass of the task
iterator over the living ones, of which only the groups whose records changed
since the last pass are looked at again (tasks.py); nothing runs per context
switch. Pids are those of the initial pid namespace, and the iterator walks
the pid namespace of the process reading it: the agent must run in the host's
(hostPID), and --procfs must show the host's processes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from kepler_bridge import capabilities
from kepler_bridge.config import Config
from kepler_bridge.model import SourceReading
from kepler_bridge.sources import pid_namespace
from kepler_bridge.sources.base import SourceAbsent, SourceUnavailable
from kepler_bridge.sources.cgroup import CgroupIdIndex, read_container_id
from kepler_bridge.sources.ebpf import kernel_headers
from kepler_bridge.sources.ebpf.bpf_syscall import BpfMap, read_iterator
from kepler_bridge.sources.ebpf.btf import BTF_PATH
from kepler_bridge.sources.ebpf.tasks import TASK, TaskGroups
from kepler_bridge.sources.process_table import ProcessSource, TrackedProcess
from kepler_bridge.turns import normal_children

log = logging.getLogger(__name__)

PROGRAM = "cpu_account.c"
LOADER = str(Path(__file__).with_name("loader.py"))
LOAD_TIMEOUT = 120.0
FALLBACK = (
    "; with --sources auto the procfs source counts CPU time instead "
    "(it misses processes that live less than one interval)"
)

_EXIT_KEY = struct.Struct("<IIQ")  # struct exit_key
_EXIT = struct.Struct("<QQ16s")  # struct exit_rec
_EXIT_COUNTS = struct.Struct("<QQ")  # struct exit_counts
_ZERO = struct.pack("<I", 0)


def program_path() -> str:
    """bpf/cpu_account.c from a source checkout, or as installed under
    <prefix>/share/kepler-bridge/bpf."""
    candidates = (
        Path(__file__).resolve().parents[3] / "bpf" / PROGRAM,
        Path(sys.prefix) / "share" / "kepler-bridge" / "bpf" / PROGRAM,
    )
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise SourceAbsent(
        f"the BPF program {PROGRAM} is not installed (looked at "
        f"{', '.join(map(str, candidates))}): reinstall kepler-bridge with its bpf/ directory"
    )


@dataclass
class LoadedProgram:
    """Descriptors handed over by the loader: programs, attachments (iterator link, tracepoint)
    and maps."""

    programs: dict[str, int]
    attached: dict[str, int]
    maps: dict[str, BpfMap]
    offsets: dict[str, int]
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Close every descriptor: this detaches the programs once no one else holds them."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


class _LoaderReply(TypedDict, total=False):
    """The loader's JSON reply: indexes into the fds it sent, or the error that stopped it."""

    programs: dict[str, int]
    attached: dict[str, int]
    maps: dict[str, int]
    offsets: dict[str, int]
    error: str


def load_program(
    map_entries: int,
    headers: kernel_headers.HeaderTree,
    btf: str | None = None,
    timeout: float = LOAD_TIMEOUT,
) -> LoadedProgram:
    """Run the loader child and take over its descriptors; SourceUnavailable says why it failed.

    btf: the BTF file member offsets are read from (default: the running kernel's).
    """
    request = {
        "program": program_path(),
        "map_entries": map_entries,
        "cflags": list(headers.cflags),
        "btf": btf,
    }
    reply, fds, diagnostics = _ask_loader(request, headers, timeout)
    if "error" in reply:
        raise SourceUnavailable(
            reply["error"]
            + (f"; bcc said: {diagnostics}" if diagnostics else "")
            + f" (kernel headers from {headers.origin})"
        )
    return LoadedProgram(
        {name: fds[i] for name, i in reply["programs"].items()},
        {name: fds[i] for name, i in reply["attached"].items()},
        {name: BpfMap(fds[i]) for name, i in reply["maps"].items()},
        reply["offsets"],
        list(fds),
    )


def _ask_loader(
    request: dict[str, object], headers: kernel_headers.HeaderTree, timeout: float
) -> tuple[_LoaderReply, list[int], str]:
    """Send the request to a loader child: its reply, the fds it passed and its output's gist."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, tempfile.TemporaryFile() as output:
        with theirs, normal_children():
            child = subprocess.Popen(
                [sys.executable, "-I", LOADER, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, **headers.environ},
            )
        try:
            ours.settimeout(timeout)
            ours.sendall(json.dumps(request).encode())
            message, fds, _, _ = socket.recv_fds(ours, 1 << 16, 64)
        except socket.timeout:
            child.kill()
            raise SourceUnavailable(
                f"the eBPF loader did not answer within {timeout:.0f}s "
                f"(compiling with headers from {headers.origin})"
            ) from None
        finally:
            child.wait()
        output.seek(0)
        diagnostics = _diagnostics(output.read().decode(errors="replace"))
    reply: _LoaderReply = (
        json.loads(message) if message else {"error": f"the eBPF loader exited {child.returncode}"}
    )
    return reply, fds, diagnostics


def _diagnostics(text: str, limit: int = 8) -> str:
    """The lines of compiler/bcc output worth showing: errors first, else the tail."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "unable" in line.lower()]
    return " | ".join((errors or lines)[-limit:])


def privilege_problem(procfs: str) -> str:
    """Why this process may not load BPF programs ('' when it may)."""
    caps = capabilities.effective(procfs)
    if caps is None or caps & capabilities.SYS_ADMIN:
        return ""
    if caps & capabilities.BPF and caps & capabilities.PERFMON:
        return ""
    return (
        "loading BPF programs needs root, or CAP_BPF with CAP_PERFMON (kernel 5.8+): "
        "run the agent as root (in Kubernetes: securityContext.privileged: true)"
    )


def btf_problem(path: str = BTF_PATH) -> str:
    """Why the kernel's BTF cannot give the programs their offsets ('' when the file is there)."""
    if os.path.isfile(path):
        return ""
    return (
        f"no {path}: the ebpf source needs a kernel built with CONFIG_DEBUG_INFO_BTF=y, "
        "5.8 or newer (Debian 11+, Ubuntu 20.10+, RHEL 8.2+); in a pod mount the host's /sys"
    )


def pid_namespace_problem(procfs: str, own: str = pid_namespace.OWN) -> str:
    """Why the task iterator would miss processes, or name them by pids --procfs does not show;
    '' when the agent (`own`) and `procfs` are in the initial pid namespace (or cannot be read)."""
    agent = pid_namespace.namespace(own)
    if pid_namespace.nested(own):
        # The kernel's task iterator walks the pid namespace of the process that reads it.
        return (
            f"the agent runs in pid namespace {agent}, not the host's: the eBPF task iterator "
            "sees only the processes of that namespace; run the pod with hostPID: true "
            "(and the host's /proc at --procfs /host/proc)"
        )
    if pid_namespace.nested(f"{procfs}/1/ns/pid"):
        shown = pid_namespace.namespace(f"{procfs}/1/ns/pid")
        return (
            f"{procfs} shows pid namespace {shown}, but eBPF reports the host's pids: run the pod "
            "with hostPID: true, or mount the host's /proc and pass --procfs /host/proc"
        )
    return ""


class EbpfSource(ProcessSource):
    """Per-process CPU seconds as the kernel accounts them,
    including processes that live between two samples."""

    name = "ebpf"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.cgroups = CgroupIdIndex(config.sysfs)
        self.headers: kernel_headers.HeaderTree | None = None
        self.loaded: LoadedProgram | None = None
        self.groups = TaskGroups()
        self.tasks = self.exits_lost = 0
        self.exits_drained = 0  # exit_counts' added when `exits` was last drained
        self.read_seconds = 0.0

    def start(self) -> None:
        procfs = self.config.procfs
        try:
            for problem in (
                privilege_problem(procfs),
                pid_namespace_problem(procfs),
                btf_problem(),
            ):
                if problem:
                    raise SourceUnavailable(problem)
            try:
                self.headers = kernel_headers.find(procfs=procfs)
            except kernel_headers.HeadersMissing as err:
                raise SourceUnavailable(str(err)) from None
            self.loaded = load_program(self.config.ebpf_map_entries, self.headers)
            self.groups = TaskGroups()
        except SourceUnavailable as err:
            raise SourceUnavailable(f"{err}{FALLBACK}") from None

    def stop(self) -> None:
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None

    def read(self) -> SourceReading:
        if self.loaded is None:
            raise SourceUnavailable("the eBPF program is not loaded (start() failed or stop() ran)")
        started = time.perf_counter()
        now = time.monotonic()
        # Ended groups first: a pid they free may already belong to a process the iterator sees.
        # A group that ends after `added` is read is drained at the next sample.
        added, lost = self._exit_counts()
        if added != self.exits_drained:
            for key, value in self.loaded.maps["exits"].drain():
                tgid, _, start = _EXIT_KEY.unpack(key)
                runtime_ns, cgroup_id, comm = _EXIT.unpack(value)
                self._ended(tgid, start, runtime_ns, cgroup_id, comm, now)
            self.exits_drained = added
        data = read_iterator(self.loaded.attached["task_iterator"])
        try:
            changed, gone = self.groups.update(data)
            for tgid, ((start, cgroup_id, comm), runtime_ns) in changed.items():
                self._alive(tgid, start, cgroup_id, comm, runtime_ns / 1e9, now)
        except Exception:
            self.groups = TaskGroups()  # changes taken but not applied: look at every group again
            raise
        for tgid in gone:
            entry = self.table.current(tgid)
            if entry is not None:
                self.table.end(entry)
        self._check_lost(lost)
        self.tasks = len(data) // TASK.size
        rows = self.table.rows()
        self.groups.retry.update(self.table.evicted)  # as procfs would, it comes back if it runs
        self.read_seconds = time.perf_counter() - started
        return SourceReading(processes=rows, ebpf_programs_attached=len(self.loaded.attached))

    def _alive(
        self, tgid: int, start: int, cgroup_id: int, comm: bytes, seconds: float, now: float
    ) -> None:
        """Update a living thread group from its iterator records."""
        entry = self.table.current(tgid)
        if entry is None or entry.start != start:
            if self.table.shut_out(tgid, start, seconds):
                return
            container_id = self._container(tgid, cgroup_id, now)
            entry = self.table.begin(tgid, start, _comm_name(comm), container_id, seconds)
        else:
            if cgroup_id != entry.cgroup_id:  # moved, perhaps out of its container: "" is the host
                self.table.relabel(entry, entry.comm, self._container(tgid, cgroup_id, now))
            self.table.count(entry, seconds)
            self.table.revive(entry)
        self._relabel(entry, comm, cgroup_id)

    def _container(self, tgid: int, cgroup_id: int, now: float) -> str:
        """The container of a thread group: from its /proc cgroup file, else its cgroup id."""
        container_id = read_container_id(self.config.procfs, tgid)
        if container_id is None:
            return self.cgroups.container_id(cgroup_id, now)
        self.cgroups.learn(cgroup_id, container_id)
        return container_id

    def _ended(
        self, tgid: int, start: int, runtime_ns: int, cgroup_id: int, comm: bytes, now: float
    ) -> None:
        """Record a thread group's final runtime; one that lived between two samples is new here."""
        entry = self.table.find(tgid, start)
        if entry is None:
            entry = self.table.begin(
                tgid,
                start,
                _comm_name(comm),
                self.cgroups.container_id(cgroup_id, now),
                runtime_ns / 1e9,
            )
        else:
            if cgroup_id != entry.cgroup_id:  # moved since the last pass, then ended
                self.table.relabel(entry, entry.comm, self._container(tgid, cgroup_id, now))
            self.table.count(entry, runtime_ns / 1e9)
        self._relabel(entry, comm, cgroup_id)
        self.table.end(entry)

    def _relabel(self, entry: TrackedProcess, comm: bytes, cgroup_id: int) -> None:
        """Follow exec (a new comm) and cgroup moves of a tracked process."""
        if comm != entry.raw_comm:
            self.table.relabel(entry, _comm_name(comm), entry.container_id)
            entry.raw_comm = comm
        entry.cgroup_id = cgroup_id

    def _exit_counts(self) -> tuple[int, int]:
        """The thread groups the program put into `exits` and those it had no room for."""
        raw = self.loaded.maps["exit_counts"].lookup(_ZERO) if self.loaded else None
        return _EXIT_COUNTS.unpack(raw) if raw else (0, 0)

    def _check_lost(self, lost: int) -> None:
        if lost > self.exits_lost:
            log.warning(
                "%d thread groups ended uncounted since the last sample: the exits map "
                "(--ebpf-map-entries %d) filled up within one interval; raise it",
                lost - self.exits_lost,
                self.config.ebpf_map_entries,
            )
            self.exits_lost = lost

    def describe(self, reading: SourceReading) -> str:
        if self.loaded is None:
            return "not loaded"
        runtime = self.loaded.offsets.get("TASK_RUNTIME")
        if {"auto", self.name} & set(self.config.sources):
            use = "used for CPU time (procfs is the fallback)"
        else:
            use = "works, but --sources leaves it out"
        headers = self.headers.origin if self.headers else "?"
        return (
            f"{use}: the kernel's per-task runtime, read by a task iterator "
            "once per sample and at sched_process_free for ended processes, "
            "nothing per context switch; "
            f"{len(reading.processes)} process(es) from {self.tasks} task(s), read in "
            f"{self.read_seconds * 1000:.1f} ms; offsets from {BTF_PATH} "
            f"(se.sum_exec_runtime at byte {runtime} of task_struct); kernel headers from {headers}"
        )


def _comm_name(comm: bytes) -> str:
    return comm.split(b"\0", 1)[0].decode(errors="replace")
