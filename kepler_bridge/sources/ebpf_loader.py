"""Short-lived child that compiles and attaches the BPF program with bcc, then hands over its fds.

Run by the ebpf source as ``python -I ebpf_loader.py FD``: it reads one JSON
request from the unix socket FD, loads ``bpf/cpu_account.c`` with bcc, and
sends back one JSON reply with the program, map and tracepoint descriptors
attached (SCM_RIGHTS). It then exits without bcc's cleanup, so bcc and LLVM
(~130 MB resident) never live in the agent and the tracepoints stay attached
through the descriptors the agent now holds. Standard library only, besides
bcc, which is found on sys.path or in the system's Python package directories.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import socket
import struct
import sys
import traceback

BCC_DIRS = ("/usr/lib/python3/dist-packages", "/usr/lib/python3/site-packages",
            *sorted(glob.glob("/usr/lib*/python3*/site-packages")))
BTF_PATH = "/sys/kernel/btf/vmlinux"
MAPS = ("cpu_ns", "task_info", "slice", "softirqs", "hw_count", "cycles_event", "instructions_event")
PERF_TYPE_HARDWARE = 0
PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_HW_INSTRUCTIONS = 1
# BTF kinds (include/uapi/linux/btf.h).
_STRUCT, _UNION = 4, 5
_MODIFIERS = (8, 9, 10, 11, 18)  # typedef, volatile, const, restrict, type tag
# Bytes that follow struct btf_type, per kind: fixed, or per member for the kinds in _BTF_PER_MEMBER.
_BTF_EXTRA = {1: 4, 3: 12, 4: 12, 5: 12, 6: 8, 13: 8, 14: 4, 15: 12, 17: 4, 19: 12}
_BTF_PER_MEMBER = {4, 5, 6, 13, 15, 19}


class LoadError(Exception):
    """Loading failed; the message says what is missing and how to fix it."""


def import_bcc():
    """Import bcc from sys.path, else from the system's package directories (that package only)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None:
        for directory in BCC_DIRS:
            init = os.path.join(directory, "bcc", "__init__.py")
            if os.path.isfile(init):
                spec = importlib.util.spec_from_file_location(
                    "bcc", init, submodule_search_locations=[os.path.dirname(init)])
                break
    if spec is None:
        raise LoadError("bcc's Python package is not installed (looked on sys.path and in "
                        f"{', '.join(BCC_DIRS)}): install python3-bpfcc (Debian/Ubuntu) or python3-bcc "
                        "(Fedora), or run make deps")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module
    spec.loader.exec_module(module)
    return module


def _hardware_counters_problem(bcc) -> str:
    """'' when perf hardware counters can be opened here, else why not."""
    fd = bcc.lib.bpf_open_perf_event(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES, -1, 0)
    if fd < 0:
        err = ctypes.get_errno()
        return f"perf_event_open(cpu-cycles) failed: {os.strerror(err) if err else 'not supported'}"
    os.close(fd)
    return ""


def task_tgid_offset(path: str = BTF_PATH) -> int | None:
    """Byte offset of tgid in struct task_struct per the running kernel's BTF; None without BTF."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError:
        return None
    magic, _, _, header, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data)
    if magic != 0xEB9F:
        return None
    strings = header + str_off
    wanted = data.find(b"\0task_struct\0", strings)
    tgid_name = data.find(b"\0tgid\0", strings)
    if wanted < 0 or tgid_name < 0:
        return None
    positions = [0]  # type id 0 is void
    pos, end = header + type_off, header + type_off + type_len
    task_struct = 0
    while pos < end:
        positions.append(pos)
        name_off, info, _ = struct.unpack_from("<III", data, pos)
        kind, vlen = info >> 24 & 0x1F, info & 0xFFFF
        if kind == _STRUCT and vlen and name_off == wanted + 1 - strings:
            task_struct = len(positions) - 1
        extra = _BTF_EXTRA.get(kind, 0)
        pos += 12 + (extra * vlen if kind in _BTF_PER_MEMBER else extra)
    if not task_struct:
        return None
    bits = _member_bits(data, positions, task_struct, tgid_name + 1 - strings)
    return None if bits is None else bits // 8


def _member_bits(data: bytes, positions: list[int], type_id: int, name_off: int) -> int | None:
    """Bit offset of a member, looking into anonymous structs and unions (randomized layouts use them)."""
    _, info, _ = struct.unpack_from("<III", data, positions[type_id])
    for index in range(info & 0xFFFF):
        member_name, member_type, offset = struct.unpack_from("<III", data, positions[type_id] + 12 + 12 * index)
        bits = offset & 0xFFFFFF if info >> 31 else offset
        if member_name == name_off:
            return bits
        if member_name == 0:
            inner = member_type
            while True:
                _, inner_info, target = struct.unpack_from("<III", data, positions[inner])
                if inner_info >> 24 & 0x1F not in _MODIFIERS:
                    break
                inner = target
            if inner_info >> 24 & 0x1F in (_STRUCT, _UNION):
                found = _member_bits(data, positions, inner, name_off)
                if found is not None:
                    return bits + found
    return None


def load(request: dict) -> tuple[dict, list[int]]:
    """Compile, load and attach; return the reply and the fds to send.

    request: program (path), map_entries, cflags; attach: "auto" (raw
    tracepoints when the kernel has BTF, else classic ones) or "tracepoint";
    hw_counters: "auto" (when the CPU has them) or "compile" (build that code
    without opening counters, to prove it passes the verifier anywhere).
    """
    bcc = import_bcc()
    features: dict[str, str] = {}
    cflags = [f"-DMAP_ENTRIES={int(request['map_entries'])}", *request.get("cflags", ())]
    offset = task_tgid_offset() if request.get("attach", "auto") == "auto" else None
    if offset is not None:
        cflags.append(f"-DTASK_TGID_OFFSET={offset}")
        features["sched_switch"] = f"raw tracepoint (task_struct.tgid at byte {offset}, from {BTF_PATH})"
        features["softirq"] = "on"
    else:
        reason = "as asked" if request.get("attach") == "tracepoint" else f"no usable {BTF_PATH}"
        if not bcc.BPF.tracepoint_exists("sched", "sched_switch"):
            raise LoadError(f"classic tracepoints ({reason}) need tracefs, which is not mounted: mount -t tracefs "
                            "tracefs /sys/kernel/tracing, or in a pod mount the host's /sys/kernel/tracing")
        features["sched_switch"] = f"tracepoint ({reason})"
        features["softirq"] = "on" if bcc.BPF.tracepoint_exists("irq", "softirq_entry") else \
            "absent: no irq:softirq_entry tracepoint"
    if features["softirq"] == "on":
        cflags.append("-DSOFTIRQ")
    compile_only = request.get("hw_counters") == "compile"
    hw_problem = "" if compile_only else _hardware_counters_problem(bcc)
    if hw_problem:
        features["hw_counters"] = f"absent: {hw_problem}"
    else:
        cflags += ["-DHW_COUNTERS", f"-DPOSSIBLE_CPUS={len(bcc.utils.get_possible_cpus())}"]
        features["hw_counters"] = "compiled, no counters opened" if compile_only else "on"
    try:
        bpf = bcc.BPF(src_file=request["program"].encode(), cflags=cflags)
    except Exception as err:
        raise LoadError(f"bcc could not compile or load {request['program']}: {err}") from None
    if features["hw_counters"] == "on":
        try:
            bpf["cycles_event"].open_perf_event(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES)
            bpf["instructions_event"].open_perf_event(PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS)
        except Exception as err:  # the program still runs; its counter reads just fail
            features["hw_counters"] = f"absent: opening per-CPU counters failed: {err}"

    fds: list[int] = []
    reply: dict = {"programs": {}, "attached": {}, "maps": {}, "features": features,
                   "switch_program": "raw_tracepoint__sched_switch" if offset is not None
                   else "tracepoint__sched__sched_switch"}
    for name, function in bpf.funcs.items():
        reply["programs"][name.decode()] = len(fds)
        fds.append(function.fd)
    for tracepoint, fd in (*bpf.tracepoint_fds.items(), *bpf.raw_tracepoint_fds.items()):
        reply["attached"][tracepoint.decode()] = len(fds)
        fds.append(fd)
    for name in MAPS:
        fd = bcc.lib.bpf_table_fd(bpf.module, name.encode())
        if fd >= 0:
            reply["maps"][name] = len(fds)
            fds.append(fd)
    return reply, fds


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[1]))
    try:
        reply, fds = load(json.loads(sock.recv(1 << 16)))
        socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    except LoadError as err:
        sock.send(json.dumps({"error": str(err)}).encode())
    except Exception:
        sock.send(json.dumps({"error": "the eBPF loader failed: " + traceback.format_exc(limit=3)}).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip bcc's atexit cleanup: it would detach the tracepoints the agent now holds.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
