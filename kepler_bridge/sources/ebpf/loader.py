"""Short-lived child that compiles and loads the BPF programs with bcc, then hands over their fds.

Run by the ebpf source as ``python -I loader.py FD``: it reads one JSON
request from the unix socket FD, loads ``bpf/cpu_account.c`` with bcc (member
offsets from the running kernel's BTF), attaches the task iterator (a BPF link)
and the sched_process_free raw tracepoint, and sends back one JSON reply with
the program, link and map descriptors (SCM_RIGHTS). It then exits without
bcc's cleanup, so bcc and LLVM (~130 MB resident) never live in the agent and
the programs stay attached through the descriptors the agent now holds.
Standard library only, besides bcc and the sibling btf.py (loaded by path).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import socket
import sys
import traceback
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kepler_bridge.sources.ebpf.btf import Btf

BCC_DIRS = (
    "/usr/lib/python3/dist-packages",
    "/usr/lib/python3/site-packages",
    *sorted(glob.glob("/usr/lib*/python3*/site-packages")),
)
MAPS = ("exits", "exit_counts")
ITERATOR = "bpf_iter__task"
BPF_TRACE_ITER = 28  # enum bpf_attach_type
# Macro -> struct and member paths (alternatives, newest kernel first) and the size the program
# reads.
FIELDS = {
    "TASK_PID": ("task_struct", ("pid",), 4),
    "TASK_TGID": ("task_struct", ("tgid",), 4),
    "TASK_RUNTIME": ("task_struct", ("se.sum_exec_runtime",), 8),
    "TASK_START": ("task_struct", ("start_boottime",), 8),
    "TASK_COMM": ("task_struct", ("comm",), 16),
    "TASK_SIGNAL": ("task_struct", ("signal",), 8),
    "TASK_CGROUPS": ("task_struct", ("cgroups",), 8),
    "SIGNAL_LIVE": ("signal_struct", ("live",), 4),
    "SIGNAL_RUNTIME": ("signal_struct", ("sum_sched_runtime",), 8),
    # seqlock_t holds a seqcount_spinlock_t since 5.10, a plain seqcount_t before.
    "SIGNAL_SEQ": (
        "signal_struct",
        ("stats_lock.seqcount.seqcount.sequence", "stats_lock.seqcount.sequence"),
        4,
    ),
    "CSS_SET_CGROUP": ("css_set", ("dfl_cgrp",), 8),
    "CGROUP_KN": ("cgroup", ("kn",), 8),
    "KERNFS_ID": ("kernfs_node", ("id",), 8),
}


class LoadError(Exception):
    """Loading failed; the message says what is missing and how to fix it."""


def _sibling(name: str) -> ModuleType:
    """Import a module next to this file (isolated mode puts no script directory on sys.path)."""
    spec = importlib.util.spec_from_file_location(
        f"_kepler_bridge_{name}",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"),
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def import_bcc() -> ModuleType:
    """Import bcc from sys.path, else from the system's package directories (that package only)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None:
        for directory in BCC_DIRS:
            init = os.path.join(directory, "bcc", "__init__.py")
            if os.path.isfile(init):
                spec = importlib.util.spec_from_file_location(
                    "bcc", init, submodule_search_locations=[os.path.dirname(init)]
                )
                break
    if spec is None:
        raise LoadError(
            "bcc's Python package is not installed (looked on sys.path and in "
            f"{', '.join(BCC_DIRS)}): install python3-bpfcc (Debian/Ubuntu) or python3-bcc "
            "(Fedora), or run make deps"
        )
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module
    spec.loader.exec_module(module)
    return module


def field_offsets(btf_path: str | None = None) -> dict[str, int]:
    """Byte offset of every member the program reads, from the running kernel's BTF; LoadError
    says what lacks."""
    btf = _sibling("btf")
    types = _kernel_types(btf, btf_path or btf.BTF_PATH)
    return {
        macro: _offset(btf, types, struct_name, paths, size)
        for macro, (struct_name, paths, size) in FIELDS.items()
    }


def _kernel_types(btf: ModuleType, path: str) -> Btf:
    """The BTF at path, which must describe a kernel with BPF task iterators."""
    try:
        types: Btf = btf.Btf.load(path)
    except OSError as err:
        raise LoadError(
            f"cannot read the kernel's BTF ({err.strerror}: {path}): the ebpf source needs a "
            "kernel built with CONFIG_DEBUG_INFO_BTF=y (5.8 or newer; Debian 11+, Ubuntu 20.10+, "
            "RHEL 8.2+); in a pod mount the host's /sys"
        ) from None
    except btf.BtfError as err:
        raise LoadError(str(err)) from None
    if not types.has_function("bpf_iter_task"):
        raise LoadError(
            f"{path} has no bpf_iter_task: the kernel lacks BPF task iterators "
            "(5.8 or newer needed)"
        )
    return types


def _offset(
    btf: ModuleType, types: Btf, struct_name: str, paths: tuple[str, ...], size: int
) -> int:
    """The offset of the first of the member's paths this kernel has, with the size read."""
    problems = []
    for path_in_struct in paths:
        try:
            member = types.member(struct_name, path_in_struct)
        except btf.BtfError as err:
            problems.append(str(err))
            continue
        if member.size == size:
            return member.offset
        problems.append(f"{struct_name}.{path_in_struct} has {member.size} bytes, not {size}")
    raise LoadError(
        "this kernel's task accounting fields differ from what the program reads: "
        + "; ".join(problems)
    )


def _attach_iterator(bcc: ModuleType, bpf: Any) -> int:
    """Load the task iterator program and create its link; return the link fd."""
    try:
        function = bpf.load_func(ITERATOR.encode(), bcc.BPF.TRACING, attach_type=BPF_TRACE_ITER)
    except Exception as err:
        raise LoadError(f"the kernel refused the task iterator program: {err}") from None
    create = bcc.lib.bpf_link_create
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    link = create(function.fd, 0, BPF_TRACE_ITER, None)
    if link < 0:
        raise LoadError(
            f"creating the task iterator link failed: {os.strerror(ctypes.get_errno() or -link)}"
        )
    return link


def load(request: dict) -> tuple[dict, list[int]]:
    """Compile, load and attach; return the reply and the fds to send.

    request: program (path), map_entries, cflags; btf (optional path of the BTF to read offsets
    from).
    """
    offsets = field_offsets(request.get("btf"))
    bcc = import_bcc()
    cflags = [
        f"-DMAP_ENTRIES={int(request['map_entries'])}",
        *request.get("cflags", ()),
        *(f"-D{macro}={offset}" for macro, offset in offsets.items()),
    ]
    try:
        bpf = bcc.BPF(src_file=request["program"].encode(), cflags=cflags)
    except Exception as err:
        raise LoadError(f"bcc could not compile or load {request['program']}: {err}") from None
    link = _attach_iterator(bcc, bpf)

    fds: list[int] = []
    reply: dict = {"programs": {}, "attached": {}, "maps": {}, "offsets": offsets}
    for name, function in bpf.funcs.items():
        reply["programs"][name.decode()] = len(fds)
        fds.append(function.fd)
    for name, fd in (
        ("task_iterator", link),
        *((tp.decode(), fd) for tp, fd in bpf.raw_tracepoint_fds.items()),
    ):
        reply["attached"][name] = len(fds)
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
        sock.send(
            json.dumps(
                {"error": "the eBPF loader failed: " + traceback.format_exc(limit=3)}
            ).encode()
        )
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip bcc's atexit cleanup: it would detach the programs the agent now holds.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
