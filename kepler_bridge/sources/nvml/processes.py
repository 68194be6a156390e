"""The processes on one GPU: their memory, SM utilization, comm and container; and whether the
agent's pid namespace hides those of other pods from NVML."""

from __future__ import annotations

import os
import time

import pynvml

from kepler_bridge.model import GpuProcess
from kepler_bridge.sources import ranges
from kepler_bridge.sources.cgroup import read_container_id
from kepler_bridge.sources.nvml.device import Device
from kepler_bridge.sources.procfs import read_stat

# NVML's answers of nvmlDeviceGetProcessUtilization when no kernel ran since the time asked about.
NOTHING_RAN = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS)


def pid_namespace_problem(procfs: str) -> str:
    """Why NVML lists no process of another pod: '' when this process is in the pid namespace
    `procfs` shows (hostPID), or where that cannot be told."""
    try:
        with open(f"{procfs}/self/status", encoding="ascii", errors="replace") as file:
            pids = next(line.split()[1:] for line in file if line.startswith("NSpid:"))
    except (OSError, StopIteration):
        return ""
    if len(pids) < 2:
        return ""
    # The driver reports each GPU process by its pid in the caller's pid namespace and leaves out
    # those that have none there, so from inside a pod it sees only the pod's own processes.
    return (
        f"the agent runs in a pid namespace of its own (pid {os.getpid()}, {pids[0]} in {procfs}): "
        "the NVIDIA driver lists only the GPU processes of that namespace, so no process or pod "
        "gets GPU energy and it all counts as idle; run the pod with hostPID: true"
    )


def gpu_processes(device: Device, procfs: str) -> tuple[GpuProcess, ...]:
    """The compute and graphics processes on the GPU, by pid; comm and container looked up once."""
    h = device.handle
    memory: dict[int, int | None] = {}
    for name, call in (
        ("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
        ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
    ):
        for proc in device.query(name, lambda: call(h)) or ():
            if memory.get(proc.pid) is None:
                memory[proc.pid] = ranges.byte_count(proc.usedGpuMemory)
    if not memory:
        return ()
    utilization = _utilization(device)
    device.comms = {
        pid: device.comms[pid] if pid in device.comms else _identity(procfs, pid) for pid in memory
    }
    return tuple(
        GpuProcess(
            pid=pid,
            comm=device.comms[pid][0],
            memory_used_bytes=used,
            utilization=None if utilization is None else utilization.get(pid, 0.0),
            container_id=device.comms[pid][1],
        )
        for pid, used in sorted(memory.items())
    )


def _utilization(device: Device) -> dict[int, float] | None:
    """SM utilization per pid since the last sample; {} when nothing ran, None when not reported."""
    since = device.last_process_sample_us
    device.last_process_sample_us = int(time.time() * 1e6)
    try:
        samples = device.query(
            "process_utilization",
            lambda: pynvml.nvmlDeviceGetProcessUtilization(device.handle, since),
        )
    except pynvml.NVMLError as err:
        if err.value in NOTHING_RAN:
            return {}
        raise
    if samples is None:
        return None
    latest: dict[int, tuple[int, float]] = {}
    for sample in samples:
        util = ranges.ratio_from_percent(sample.smUtil)
        if util is not None and sample.timeStamp >= latest.get(sample.pid, (0, 0.0))[0]:
            latest[sample.pid] = (sample.timeStamp, util)
    return {pid: util for pid, (_, util) in latest.items()}


def _identity(procfs: str, pid: int) -> tuple[str, str]:
    """comm (as the CPU sources name it) and container id of a process; '' where it is unseen."""
    stat = read_stat(procfs, pid)
    if stat is None:
        return "", ""
    return stat.comm, read_container_id(procfs, pid) or ""
