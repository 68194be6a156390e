"""The processes on one GPU: their memory, SM utilization, comm and container; and whether the
agent's pid namespace hides those of other pods from NVML.

The process lists are read into buffers kept per GPU and NVML call (with the function and the
count), with the records unpacked straight from them: one NVML call each while the buffer is large
enough (pynvml's wrappers ask twice, the first time for the count, and convert each record field
by field)."""

from __future__ import annotations

import ctypes
import os
import struct
from operator import itemgetter
from typing import Any, Callable

import pynvml

from kepler_bridge.model import GpuProcess
from kepler_bridge.sources import pid_namespace, ranges
from kepler_bridge.sources.cgroup import read_container_id
from kepler_bridge.sources.nvml.device import Device
from kepler_bridge.sources.procfs import read_stat

COMPUTE = "nvmlDeviceGetComputeRunningProcesses_v3"
GRAPHICS = "nvmlDeviceGetGraphicsRunningProcesses_v3"
UTILIZATION = "nvmlDeviceGetProcessUtilization"
# nvmlProcessInfo_t as the _v3 lists fill it: pid, used memory, GPU and compute instance ids.
PROCESS_INFO = struct.Struct("@IQII")
# nvmlProcessUtilizationSample_t: pid, time stamp (µs), SM, memory, encoder, decoder utilization.
UTILIZATION_SAMPLE = struct.Struct("@IQIIII")
FIRST_CAPACITY = 32  # records a new buffer holds
GROW_TRIES = 4  # NVML may answer "too small" again when the list grew meanwhile

# ranges.ratio_from_percent of each whole percentage (the SM utilization of a process sample).
PERCENTS = tuple(ranges.ratio_from_percent(percent) for percent in range(101))

# NVML's answer of nvmlDeviceGetProcessUtilization when no kernel ran since the time asked about.
NOTHING_RAN = pynvml.NVML_ERROR_NOT_FOUND


def pid_namespace_problem(procfs: str) -> str:
    """Why NVML lists no process of another pod: '' when this process is in the host's pid
    namespace (hostPID), or where that cannot be told."""
    if not pid_namespace.nested(f"{procfs}/self/ns/pid"):
        return ""
    # The driver reports each GPU process by its pid in the caller's pid namespace and leaves out
    # those that have none there, so from inside a pod it sees only the pod's own processes.
    return (
        f"the agent runs in a pid namespace of its own (pid {os.getpid()}, "
        f"{pid_namespace.namespace(f'{procfs}/self/ns/pid')}): "
        "the NVIDIA driver lists only the GPU processes of that namespace, so no process or pod "
        "gets GPU energy and it all counts as idle; run the pod with hostPID: true"
    )


def gpu_processes(device: Device, procfs: str) -> tuple[GpuProcess, ...]:
    """The compute and graphics processes on the GPU, by pid; comm and container looked up once."""
    memory = _memory(device)
    if not memory:
        device.process_rows, device.process_inputs = {}, None
        return ()
    utilization = _utilization(device)
    if device.process_inputs == (memory, utilization):
        return tuple(device.process_rows.values())  # what the rows below would be: the last ones
    device.process_inputs = (memory, utilization)
    device.comms = {
        pid: device.comms[pid] if pid in device.comms else _identity(procfs, pid) for pid in memory
    }
    last, rows = device.process_rows, {}
    for pid, used in sorted(memory.items()):
        util = None if utilization is None else utilization.get(pid, 0.0)
        row = last.get(pid)
        # The last read's row where it holds the same values: no new record, and the sanitiser
        # and the sampler get the very object again.
        if row is None or row.memory_used_bytes != used or row.utilization != util:
            comm, container_id = device.comms[pid]
            row = GpuProcess(pid, comm, used, util, container_id)
        rows[pid] = row
    device.process_rows = rows
    return tuple(rows.values())


def _memory(device: Device) -> dict[int, int | None]:
    """Used memory by pid over the compute and graphics lists; where NVML refuses a MIG parent's
    compute list (to a caller without privileges), its MIG devices' own, as mig.py read them."""
    h = device.handle
    compute = device.query("compute_processes", running_processes, device, COMPUTE, h)
    if compute is None and device.mig_enabled:
        compute = device.mig_processes.items()
    memory: dict[int, int | None] = {}
    for listed in (
        compute,
        device.query("graphics_processes", running_processes, device, GRAPHICS, h),
    ):
        for pid, used in listed or ():
            if memory.get(pid) is None:
                memory[pid] = used
    return memory


def running_processes(device: Device, call: str, handle: Any) -> list[tuple[int, int | None]]:
    """(pid, used memory bytes, None where NVML cannot tell or out of range) of each process in
    one of NVML's process lists (COMPUTE or GRAPHICS) of a GPU or MIG device; NVMLError raises."""
    records = _listed(
        device, call, PROCESS_INFO, lambda function, count, buffer: function(handle, count, buffer)
    )
    # ranges.byte_count of an unsigned count, inline as it runs for every process; what NVML
    # gives when it cannot tell (NVML_VALUE_NOT_AVAILABLE, 2**64 - 1: Windows WDDM) is beyond it.
    return [(pid, used if used < ranges.MAX_BYTES else None) for pid, used, _, _ in records]


def _listed(
    device: Device,
    call: str,
    record: struct.Struct,
    ask: Callable[[Any, Any, ctypes.Array], int],
) -> list[tuple[Any, ...]]:
    """The records of an NVML list call, asked with `ask(function, count pointer, buffer)`, read
    into the device's buffer for that call, which grows when NVML says it is too small."""
    kept = device.lists.get(call)
    if kept is None:
        # pynvml's own lookup, as its wrappers do: FunctionNotFound on an older driver.
        count = ctypes.c_uint()
        buffer = ctypes.create_string_buffer(record.size * FIRST_CAPACITY)
        kept = device.lists[call] = (
            pynvml._nvmlGetFunctionPointer(call),
            count,
            ctypes.byref(count),
            buffer,
        )
    function, count, pointer, buffer = kept
    for _ in range(GROW_TRIES):
        count.value = len(buffer) // record.size
        result = ask(function, pointer, buffer)
        if result != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            break
        buffer = ctypes.create_string_buffer(record.size * (count.value * 2 + 5))
        device.lists[call] = (function, count, pointer, buffer)
    if result != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(result)
    return list(record.iter_unpack(memoryview(buffer)[: count.value * record.size]))


def _utilization(device: Device) -> dict[int, float] | None:
    """SM utilization per pid since the last sample; {} when nothing ran, None when not reported.
    Asked for the samples after the newest one seen, as NVML's documentation says: not after the
    clock at the last call, which loses a sample NVML publishes late (or after an NTP step)."""
    since = ctypes.c_ulonglong(device.last_process_sample_us)
    try:
        samples = device.query(
            "process_utilization",
            _listed,
            device,
            UTILIZATION,
            UTILIZATION_SAMPLE,
            lambda function, count, buffer: function(device.handle, buffer, count, since),
        )
    except pynvml.NVMLError as err:
        if err.value == NOTHING_RAN:
            return {}
        raise
    if samples is None:
        return None
    # A pid's latest sample last (the sort is stable: of two alike, the one NVML listed later).
    samples.sort(key=itemgetter(1))
    if samples:
        device.last_process_sample_us = max(device.last_process_sample_us, samples[-1][1])
    return {pid: PERCENTS[sm] for pid, _, sm, _, _, _ in samples if sm <= 100}


def _identity(procfs: str, pid: int) -> tuple[str, str]:
    """comm (as the CPU sources name it) and container id of a process; '' where it is unseen."""
    stat = read_stat(procfs, pid)
    if stat is None:
        return "", ""
    return stat.comm, read_container_id(procfs, pid) or ""
