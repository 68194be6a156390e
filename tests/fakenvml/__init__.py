"""Fake NVIDIA driver library (``libnvidia-ml.so.1``) for tests.

``fakenvml.c`` in this directory is a small C library exporting the NVML
symbols the agent uses, so tests run the REAL ``pynvml`` binding
(nvidia-ml-py) against config-driven values with run-time fault injection.

Typical use::

    lib = build(tmp_dir)                       # compiles once, cached
    fake = FakeNvml(lib, tmp_dir / "nvml.conf", gpus=2, processes_per_gpu=2)
    env = {**os.environ, **fake.env()}         # for the process that loads the lib
    # in that process: pynvml.nvmlLib = ctypes.CDLL(str(lib)); pynvml.nvmlInit()
    fake.gpu(0, utilization_gpu=97)            # seen by the next NVML call
    fake.gpu(1, lost=True)                     # GPU 1 -> pynvml.NVMLError_GpuIsLost (15)
    fake.set(fail_all=999)                     # every call -> NVMLError_Unknown
    fake.add_xid(0, 79)                        # delivered by nvmlEventSetWait_v2
    fake.gpu(0, gpm_supported=True, gpm_metrics={pynvml.NVML_GPM_METRIC_SM_UTIL: 42.5})
    fake.calls()["nvmlDeviceGetFanSpeed"]      # calls made by that process

Load the library in a separate process per scenario: ctypes cannot unload a
library and pynvml keeps module globals (``nvmlLib``, a refcount and a cache
of function pointers, ``_nvmlGetFunctionPointer_cache``) that would otherwise
leak between tests.

The config is a ``key=value`` text file, rewritten atomically (temp file +
``os.replace``) by every setter; the library re-reads it when it changes.
See README.md for every key, its unit and the fault knobs.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "build",
    "FakeNvml",
    "SOURCE",
    "LIBRARY_NAME",
    "GLOBAL_FIELDS",
    "NVML_PCIE_THROUGHPUT_MS",
    "GPU_FIELDS",
    "PROCESS_FIELDS",
    "MIG_FIELDS",
    "NO_INSTANCE",
    "mig_uuid",
    "default_gpu",
    "default_process",
]

SOURCE = Path(__file__).resolve().parent / "fakenvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"

CFLAGS = [
    "-std=c11",
    "-shared",
    "-fPIC",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-pthread",
    "-Wl,-soname," + LIBRARY_NAME,
]

_build_lock = threading.Lock()


def build(outdir: Path) -> Path:
    """Compile ``fakenvml.c`` into ``outdir/libnvidia-ml.so.1`` and return its path.

    Skips the compile when the library exists and is newer than the source.
    Compiles to a temporary name and renames, so concurrent builders (xdist
    workers) never see a half-written library.  ``$CC`` overrides ``gcc``.
    Raises RuntimeError with the compiler output when the compile fails.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    lib = outdir / LIBRARY_NAME
    with _build_lock:
        if lib.exists() and lib.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns:
            return lib
        cc = os.environ.get("CC") or shutil.which("gcc") or "cc"
        tmp = outdir / f".{LIBRARY_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        cmd = [cc, *CFLAGS, "-o", str(tmp), str(SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(
                f"building the fake NVML library failed (exit {proc.returncode}: "
                f"{' '.join(cmd)}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        os.replace(tmp, lib)
        return lib


# --------------------------------------------------------------------------
# Field names (Python keyword == config key). Units are NVML's.
# --------------------------------------------------------------------------

#: how long NVML's nvmlDeviceGetPcieThroughput measures the link before it answers (its
#: documentation): benchmarks give the fake this `pcie_throughput_ms`, so a reader that asks it
#: each sample pays what it would on a GPU
NVML_PCIE_THROUGHPUT_MS = 20

#: global settings accepted by FakeNvml.set()
GLOBAL_FIELDS = {
    "driver_version": "str, nvmlSystemGetDriverVersion",
    "nvml_version": "str, nvmlSystemGetNVMLVersion",
    "device_count": "int, nvmlDeviceGetCount_v2 (clamped to 64)",
    "init_error": "NVML return code returned by nvmlInitWithFlags/nvmlInit_v2 (0 = ok)",
    "fail_all": (
        "NVML return code returned by every call except init/shutdown/errorString (0 = off)"
    ),
    "delay_ms": "every call sleeps this many ms (slow driver)",
    "pcie_throughput_ms": "nvmlDeviceGetPcieThroughput measures this many ms (NVML: 20)",
    "errors": "dict {nvml function name: return code} injected for every call of that function",
}

#: per-GPU fields accepted by FakeNvml.gpu()
GPU_FIELDS = {
    "name": "str, nvmlDeviceGetName",
    "uuid": "str, nvmlDeviceGetUUID",
    "pci_bus_id": "str 'DDDDDDDD:BB:DD.F', nvmlDeviceGetPciInfo_v3",
    "pci_device_id": "int, PCI device/vendor id (0x20B010DE)",
    "pci_subsystem_id": "int",
    "utilization_gpu": "%, nvmlDeviceGetUtilizationRates().gpu",
    "utilization_memory": "%, nvmlDeviceGetUtilizationRates().memory",
    "encoder_utilization": "%, nvmlDeviceGetEncoderUtilization",
    "decoder_utilization": "%, nvmlDeviceGetDecoderUtilization",
    "memory_total": "bytes, nvmlDeviceGetMemoryInfo(_v2)",
    "memory_used": "bytes",
    "memory_free": "bytes",
    "memory_reserved": "bytes (v2 only)",
    "memory_v2": "bool; False -> nvmlDeviceGetMemoryInfo_v2 returns NOT_SUPPORTED",
    "temperature": "degrees C, nvmlDeviceGetTemperature(sensor 0)",
    "memory_temperature": "degrees C, nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP=82)",
    "power_usage": "mW, nvmlDeviceGetPowerUsage",
    "power_limit": "mW, nvmlDeviceGetEnforcedPowerLimit",
    "total_energy": "mJ since driver load, nvmlDeviceGetTotalEnergyConsumption",
    "clock_graphics": "MHz, nvmlDeviceGetClockInfo(NVML_CLOCK_GRAPHICS=0)",
    "clock_sm": "MHz, nvmlDeviceGetClockInfo(NVML_CLOCK_SM=1)",
    "clock_memory": "MHz, nvmlDeviceGetClockInfo(NVML_CLOCK_MEM=2)",
    "clock_video": "MHz, nvmlDeviceGetClockInfo(NVML_CLOCK_VIDEO=3)",
    "fan_speed": "%, nvmlDeviceGetFanSpeed",
    "pcie_tx": "KB/s, nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES=0)",
    "pcie_rx": "KB/s, nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_RX_BYTES=1)",
    "performance_state": "0..15, 32 = unknown, nvmlDeviceGetPerformanceState",
    "clocks_event_reasons": "bitmask, nvmlDeviceGetCurrentClocksEventReasons/ThrottleReasons",
    "ecc_corrected_volatile": "count, nvmlDeviceGetTotalEccErrors(0, 0)",
    "ecc_uncorrected_volatile": "count, nvmlDeviceGetTotalEccErrors(1, 0)",
    "ecc_corrected_aggregate": "count, nvmlDeviceGetTotalEccErrors(0, 1)",
    "ecc_uncorrected_aggregate": "count, nvmlDeviceGetTotalEccErrors(1, 1)",
    "supported_event_types": "bitmask, nvmlDeviceGetSupportedEventTypes (0x1F)",
    "gpm_supported": "bool, nvmlGpmQueryDeviceSupport().isSupportedDevice (Hopper and newer)",
    "gpm_metrics": "dict {NVML_GPM_METRIC_* id: rate in % or MiB/s} the GPM counters advance by",
    "gpm_not_supported": "list of NVML_GPM_METRIC_* ids whose metric answers NOT_SUPPORTED",
    "nvlink_count": "NVLinks (0: none), nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_LINK_COUNT=91)",
    "nvlink_down": "list of link numbers whose nvmlDeviceGetNvLinkState is inactive (0)",
    "nvlink_tx_kib": "list, a KiB counter per link, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX=138",
    "nvlink_rx_kib": "list, a KiB counter per link, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX=139",
    "nvlink_replay": "list, a count per link, nvmlDeviceGetNvLinkErrorCounter(link, 0)",
    "nvlink_recovery": "list, a count per link, nvmlDeviceGetNvLinkErrorCounter(link, 1)",
    "nvlink_crc_flit": "list, a count per link, nvmlDeviceGetNvLinkErrorCounter(link, 2)",
    "nvlink_crc_data": "list, a count per link, nvmlDeviceGetNvLinkErrorCounter(link, 3)",
    "remapped_rows_correctable": "rows, nvmlDeviceGetRemappedRows()[0]",
    "remapped_rows_uncorrectable": "rows, nvmlDeviceGetRemappedRows()[1]",
    "remapped_rows_pending": "0/1, nvmlDeviceGetRemappedRows()[2]",
    "remapped_rows_failure": "0/1, nvmlDeviceGetRemappedRows()[3]",
    "retired_pages_single_bit": "pages, nvmlDeviceGetRetiredPages(cause 0)",
    "retired_pages_double_bit": "pages, nvmlDeviceGetRetiredPages(cause 1)",
    "retired_pages_pending": "0/1, nvmlDeviceGetRetiredPagesPendingStatus",
    "pcie_replay_counter": "count, nvmlDeviceGetPcieReplayCounter",
    "violation_power": "ns, nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_POWER=0)",
    "violation_thermal": "ns, nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_THERMAL=1)",
    "violation_sync_boost": "ns, nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_SYNC_BOOST=2)",
    "violation_board_limit": "ns, nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_BOARD_LIMIT=3)",
    "violation_low_utilization": "ns, nvmlDeviceGetViolationStatus(LOW_UTILIZATION=4)",
    "violation_reliability": "ns, nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_RELIABILITY=5)",
    "lost": "bool; every call on this device returns GPU_IS_LOST (15)",
    "delay_ms": "extra ms every call on this device sleeps",
    "not_supported": "list of field/alias/function names returning NOT_SUPPORTED (3)",
    "errors": "dict {field/alias/function name: return code}",
}

#: keys of one process dict given to FakeNvml.processes()
PROCESS_FIELDS = {
    "pid": "int",
    "used_memory": "bytes (2**64-1 = NVML_VALUE_NOT_AVAILABLE -> pynvml gives None)",
    "sm_util": "%, process utilization sample",
    "mem_util": "%",
    "enc_util": "%",
    "dec_util": "%",
    "type": "'compute' | 'graphics' | 'both'",
    "timestamp": "µs since the epoch of the utilization sample; 0 = the time of the call",
    "gpu_instance": "MIG: id of the GPU instance it runs in (NO_INSTANCE: none)",
    "compute_instance": "MIG: id of its compute instance in that GPU instance",
}

#: gpu/compute instance id of a process outside MIG (NVML's 0xFFFFFFFF)
NO_INSTANCE = 0xFFFFFFFF

#: keys of one MIG device dict given to FakeNvml.mig()
MIG_FIELDS = {
    "gpu_instance": "int 0..15, required",
    "compute_instance": "int 0..7, required",
    "profile": "GPU instance profile: 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb, 1g.20gb, "
    "1g.10gb+me (an A100 80GB's)",
    "memory_used": "bytes used in its GPU instance (the first device of the instance counts)",
    "uuid": "str; default mig_uuid(gpu, gpu_instance, compute_instance)",
    "gpm_metrics": "dict {NVML_GPM_METRIC_* id: rate} of its GPU instance for nvmlGpmMigSampleGet "
    "(the first device of the instance counts; default every rate 0)",
}


def mig_uuid(gpu: int, gpu_instance: int, compute_instance: int) -> str:
    """The default uuid of a MIG device (as the C library makes it)."""
    return f"MIG-fa4e0000-{gpu:04x}-4000-8000-{gpu_instance:06x}{compute_instance:06x}"


_GiB = 1024**3
_MiB = 1024**2


def default_gpu(index: int) -> dict[str, Any]:
    """The plausible values FakeNvml writes for GPU ``index`` (same as the C defaults)."""
    total = 80 * _GiB
    reserved = 512 * _MiB
    used = 10 * _GiB
    return {
        "name": "NVIDIA Fake A100",
        "uuid": f"GPU-fa4e0000-0000-4000-8000-{index:012x}",
        "pci_bus_id": f"00000000:{(0x10 + index) & 0xFF:02X}:00.0",
        "pci_device_id": 0x20B010DE,
        "pci_subsystem_id": 0x134F10DE,
        "utilization_gpu": 50,
        "utilization_memory": 30,
        "encoder_utilization": 0,
        "decoder_utilization": 0,
        "memory_total": total,
        "memory_used": used,
        "memory_free": total - reserved - used,
        "memory_reserved": reserved,
        "memory_v2": True,
        "temperature": 60,
        "memory_temperature": 70,
        "power_usage": 250_000,
        "power_limit": 400_000,
        "total_energy": 1_000_000_000 + index * 1_000_000,
        "clock_graphics": 1410,
        "clock_sm": 1410,
        "clock_memory": 1593,
        "clock_video": 1275,
        "fan_speed": 40,
        "pcie_tx": 1000,
        "pcie_rx": 2000,
        "performance_state": 0,
        "clocks_event_reasons": 0,
        "ecc_corrected_volatile": 0,
        "ecc_uncorrected_volatile": 0,
        "ecc_corrected_aggregate": 0,
        "ecc_uncorrected_aggregate": 0,
        "supported_event_types": 0x1F,
        "gpm_supported": False,
        "gpm_metrics": {},
        "gpm_not_supported": [],
        "nvlink_count": 0,
        "nvlink_down": [],
        "nvlink_tx_kib": [],
        "nvlink_rx_kib": [],
        "nvlink_replay": [],
        "nvlink_recovery": [],
        "nvlink_crc_flit": [],
        "nvlink_crc_data": [],
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": 0,
        "remapped_rows_failure": 0,
        "retired_pages_single_bit": 0,
        "retired_pages_double_bit": 0,
        "retired_pages_pending": 0,
        "pcie_replay_counter": 0,
        "violation_power": 0,
        "violation_thermal": 0,
        "violation_sync_boost": 0,
        "violation_board_limit": 0,
        "violation_low_utilization": 0,
        "violation_reliability": 0,
        "lost": False,
        "delay_ms": 0,
        "not_supported": [],
        "errors": {},
    }


def default_process(pid: int, n: int = 0) -> dict[str, Any]:
    """A plausible compute process (``n`` varies memory and utilization)."""
    return {
        "pid": pid,
        "used_memory": (n + 1) * _GiB,
        "sm_util": 20 + 10 * n,
        "mem_util": 10 + 5 * n,
        "enc_util": 0,
        "dec_util": 0,
        "type": "compute",
        "timestamp": 0,
        "gpu_instance": NO_INSTANCE,
        "compute_instance": NO_INSTANCE,
    }


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, bool):
        text = "1" if value else "0"
    elif value is None:
        text = ""
    elif isinstance(value, dict):
        text = ",".join(
            f"{k}:{v!r}" if isinstance(v, float) else f"{k}:{int(v)}" for k, v in value.items()
        )
    elif isinstance(value, (list, tuple, set, frozenset)):
        text = ",".join(str(v) for v in value)
    else:
        text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError(f"fakenvml: {key} must not contain a newline: {value!r}")
    return text


class FakeNvml:
    """Writes and updates the config file of the fake NVML library.

    ``FakeNvml(library, config, gpus=2, processes_per_gpu=0, stats=None)``
    writes a plausible default config immediately: ``gpus`` devices named
    "NVIDIA Fake A100" with distinct ``GPU-...`` uuids, 80 GiB memory, 50 %
    utilization, 60 C, 250 W (limit 400 W), an energy counter, clocks and
    ``processes_per_gpu`` compute processes per GPU with pids 1000, 1001, ...
    (unique across GPUs).  ``stats`` defaults to ``<config>.stats``.

    The current values are kept in ``globals``, ``gpus`` (one dict per GPU,
    see GPU_FIELDS), ``procs`` (GPU index -> list of process dicts) and
    ``xids`` ((gpu, xid) in order); treat them as read-only and change them
    through the setters, each of which rewrites the config atomically.
    """

    def __init__(
        self,
        library: Path,
        config: Path,
        gpus: int = 2,
        processes_per_gpu: int = 0,
        stats: Path | None = None,
    ) -> None:
        self.library = Path(library)
        self.config = Path(config)
        self.stats: Path | None = (
            Path(stats) if stats is not None else self.config.with_name(self.config.name + ".stats")
        )
        self._lock = threading.RLock()
        self.globals: dict[str, Any] = {
            "driver_version": "550.54.15",
            "nvml_version": "12.550.54.15",
            "device_count": gpus,
            "init_error": 0,
            "fail_all": 0,
            "delay_ms": 0,
            "pcie_throughput_ms": 0,
            "errors": {},
        }
        self.gpus: list[dict[str, Any]] = [default_gpu(i) for i in range(gpus)]
        self.procs: dict[int, list[dict[str, Any]]] = {}
        pid = 1000
        for i in range(gpus):
            self.procs[i] = []
            for n in range(processes_per_gpu):
                self.procs[i].append(default_process(pid, n))
                pid += 1
        self.xids: list[tuple[int, int]] = []
        self.migs: dict[int, tuple[bool, bool, list[dict[str, Any]]]] = {}
        self._write()

    # -- environment -----------------------------------------------------

    def env(self) -> dict[str, str]:
        """Variables to merge into the environment of the process loading the library."""
        env = {"FAKE_NVML_CONFIG": str(self.config)}
        if self.stats is not None:
            env["FAKE_NVML_STATS"] = str(self.stats)
        return env

    # -- setters ---------------------------------------------------------

    def set(self, **globals: Any) -> None:
        """Change global settings, e.g. ``set(fail_all=999)``, ``set(delay_ms=500)``,
        ``set(init_error=9)``, ``set(device_count=8)``,
        ``set(errors={"nvmlDeviceGetCount_v2": 999})``.

        Raising ``device_count`` adds default GPUs for the new indices.
        """
        unknown = set(globals) - set(GLOBAL_FIELDS)
        if unknown:
            raise TypeError(
                f"fakenvml: unknown global setting(s) {sorted(unknown)}; "
                f"known: {sorted(GLOBAL_FIELDS)}"
            )
        with self._lock:
            self.globals.update(globals)
            count = int(self.globals["device_count"])
            self._ensure_gpus(min(count, 64))
            self._write()

    def gpu(self, index: int, **fields: Any) -> None:
        """Change fields of GPU ``index`` (see GPU_FIELDS), e.g. ``gpu(0, lost=True)``,
        ``gpu(1, utilization_gpu=250)``, ``gpu(0, not_supported=["fan_speed", "power_usage"])``,
        ``gpu(0, memory_used=123)``, ``gpu(0, errors={"temperature": 999})``.

        Values are not validated: garbage such as 4294967295 is returned as is.
        A GPU beyond the current list is created with defaults (device_count is
        not changed).
        """
        unknown = set(fields) - set(GPU_FIELDS)
        if unknown:
            raise TypeError(
                f"fakenvml: unknown GPU field(s) {sorted(unknown)}; known: {sorted(GPU_FIELDS)}"
            )
        if not 0 <= index < 64:
            raise ValueError("fakenvml: GPU index must be 0..63")
        with self._lock:
            self._ensure_gpus(index + 1)
            self.gpus[index].update(fields)
            self._write()

    def processes(self, index: int, procs: list[dict]) -> None:
        """Replace the processes of GPU ``index``.

        Each dict: ``pid`` (required), ``used_memory`` (bytes), ``sm_util``,
        ``mem_util``, ``enc_util``, ``dec_util`` (%), ``type``
        ('compute' | 'graphics' | 'both'), ``timestamp`` (µs of the
        utilization sample, 0 = time of the call).  Missing keys are 0 / compute.
        """
        cleaned = []
        for p in procs:
            unknown = set(p) - set(PROCESS_FIELDS)
            if unknown:
                raise TypeError(f"fakenvml: unknown process field(s) {sorted(unknown)}")
            if "pid" not in p:
                raise TypeError("fakenvml: a process needs a pid")
            full = {k: 0 for k in PROCESS_FIELDS}
            full["type"] = "compute"
            full["gpu_instance"] = full["compute_instance"] = NO_INSTANCE
            full.update(p)
            if full["type"] not in ("compute", "graphics", "both"):
                raise ValueError(
                    f"fakenvml: process type must be compute, graphics or both: {full['type']!r}"
                )
            cleaned.append(full)
        with self._lock:
            self.procs[index] = cleaned
            self._write()

    def mig(
        self,
        index: int,
        devices: list[dict[str, Any]],
        mode: bool = True,
        pending: bool | None = None,
    ) -> None:
        """Put GPU ``index`` in MIG mode (``mode``; ``pending`` defaults to it) with these MIG
        devices (see MIG_FIELDS), replacing the previous ones; a device left out is destroyed."""
        for device in devices:
            unknown = set(device) - set(MIG_FIELDS)
            if unknown:
                raise TypeError(f"fakenvml: unknown MIG device field(s) {sorted(unknown)}")
        with self._lock:
            self.migs[index] = (mode, mode if pending is None else pending, list(devices))
            self._write()

    def add_xid(self, index: int, xid: int) -> None:
        """Append an XID event for GPU ``index`` (delivered, in order, once, to
        every event set created before it that registered
        nvmlEventTypeXidCriticalError on that GPU)."""
        with self._lock:
            self.xids.append((int(index), int(xid)))
            self._write()

    def printed(self, script: str, *args: str) -> tuple[Any, str]:
        """The JSON a Python ``script`` prints, run with this library (argv[1], then ``args``)
        in a process of its own (pynvml's state is per process); and its stderr."""
        done = subprocess.run(
            [sys.executable, "-c", script, str(self.library), *args],
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return json.loads(done.stdout), done.stderr

    # -- stats -----------------------------------------------------------

    def calls(self, settle: float = 0.15) -> dict[str, int]:
        """Calls per NVML function made so far by the process using the library
        (the last one to write, when several processes share the stats file).

        Failed calls count too.  The library rewrites the stats file at most
        every 50 ms (a flusher thread writes what is pending), so when the file
        changed less than ``settle`` seconds ago this waits until it is that old
        before reading: every call that returned before ``calls()`` was called
        is then included.  Returns a ``collections.Counter`` (names never called
        count 0); empty when nothing was called yet.
        """
        counts: collections.Counter[str] = collections.Counter()
        if self.stats is None:
            return counts
        try:
            age = time.time() - self.stats.stat().st_mtime
            if age < settle:
                time.sleep(min(settle, settle - age))
            text = self.stats.read_text()
        except FileNotFoundError:
            return counts
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, n = line.partition(" ")
            try:
                counts[name] = int(n)
            except ValueError:
                continue
        return counts

    # -- internals -------------------------------------------------------

    def _ensure_gpus(self, n: int) -> None:
        while len(self.gpus) < n:
            i = len(self.gpus)
            self.gpus.append(default_gpu(i))
            self.procs.setdefault(i, [])

    def render(self) -> str:
        """The config text as it is written to ``self.config``."""
        with self._lock:
            lines = ["# fake NVML config (tests/fakenvml); see tests/fakenvml/README.md"]
            for key, value in self.globals.items():
                lines.append(f"{key}={_fmt(key, value)}")
            for i, g in enumerate(self.gpus):
                for key, value in g.items():
                    lines.append(f"gpu.{i}.{key}={_fmt(key, value)}")
                for p in self.procs.get(i, []):
                    cols = [
                        p["pid"],
                        p["used_memory"],
                        p["sm_util"],
                        p["mem_util"],
                        p["enc_util"],
                        p["dec_util"],
                        p["type"],
                        p["timestamp"],
                        p["gpu_instance"],
                        p["compute_instance"],
                    ]
                    lines.append(f"gpu.{i}.process={_fmt('process', cols)}")
                lines.extend(self._mig_lines(i))
            for gpu, xid in self.xids:
                lines.append(f"xid={gpu},{xid}")
            return "\n".join(lines) + "\n"

    def _mig_lines(self, i: int) -> list[str]:
        if i not in self.migs:
            return []
        mode, pending, devices = self.migs[i]
        lines = [f"gpu.{i}.mig_mode={int(mode)}", f"gpu.{i}.mig_pending_mode={int(pending)}"]
        rated: set[int] = set()
        for d in devices:
            gi, ci = d["gpu_instance"], d["compute_instance"]
            cols = [gi, ci, d.get("profile", "1g.10gb"), d.get("memory_used", 0)]
            cols.append(d.get("uuid", mig_uuid(i, gi, ci)))
            lines.append(f"gpu.{i}.mig={_fmt('mig', cols)}")
            if "gpm_metrics" in d and gi not in rated:
                rated.add(gi)
                lines.append(f"gpu.{i}.mig_gpm={gi},{_fmt('gpm_metrics', d['gpm_metrics'])}")
        return lines

    def _write(self) -> None:
        with self._lock:
            text = self.render()
            self.config.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.config.with_name(
                f".{self.config.name}.{os.getpid()}.{threading.get_ident()}.tmp"
            )
            tmp.write_text(text, errors="surrogateescape")  # "\udcff" writes the byte 0xff
            os.replace(tmp, self.config)

    def __repr__(self) -> str:
        return f"FakeNvml(config={str(self.config)!r}, gpus={len(self.gpus)})"
