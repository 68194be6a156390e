"""The fake libnvidia-ml.so.1 (tests/fakenvml) driven through the REAL pynvml binding.

Every scenario runs pynvml in its own child process (ctypes cannot unload a
library and pynvml keeps module-level state), controlled over a JSON-lines
pipe, while this process rewrites the config through FakeNvml.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pynvml
import pytest

from fakenvml import CFLAGS, LIBRARY_NAME, SOURCE, FakeNvml, build, default_gpu

CHILD = r'''
import ctypes, json, sys, time, traceback
import pynvml

pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
objs = []
handles = {}

def H(i):
    """Device handle i (cached, so tests can count calls precisely)."""
    if i not in handles:
        handles[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
    return handles[i]

def addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value

def to_json(v):
    if isinstance(v, bytes):
        return v.decode()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, ctypes.Array)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, ctypes._Pointer):
        objs.append(v)
        return {"ref": len(objs) - 1, "addr": addr(v)}
    if isinstance(v, ctypes.Union):
        return {"uiVal": v.uiVal, "ullVal": v.ullVal}
    if isinstance(v, ctypes.Structure):
        return {name: to_json(getattr(v, name)) for name, *_ in v._fields_}
    if isinstance(v, pynvml.nvmlFriendlyObject):
        return to_json(dict(v.__dict__))
    if hasattr(v, "value"):
        return to_json(v.value)
    return repr(v)

def from_json(a):
    if isinstance(a, dict) and "h" in a:
        return H(a["h"])
    if isinstance(a, dict) and "ref" in a:
        return objs[a["ref"]]
    if isinstance(a, list):
        return [from_json(x) for x in a]
    return a

ns = {"pynvml": pynvml, "H": H, "addr": addr, "ctypes": ctypes, "time": time}
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.monotonic()
    try:
        if "exec" in req:
            ns["result"] = None
            exec(req["exec"], ns)
            value = ns["result"]
        else:
            value = getattr(pynvml, req["call"])(*from_json(req.get("args", [])))
        resp = {"ok": to_json(value)}
    except pynvml.NVMLError as e:
        resp = {"err": e.value, "cls": type(e).__name__, "str": str(e)}
    except Exception as e:
        resp = {"exc": type(e).__name__, "str": str(e), "tb": traceback.format_exc()}
    resp["elapsed"] = time.monotonic() - t0
    sys.stdout.write(json.dumps(resp) + "\n")
    sys.stdout.flush()
'''


class NvmlErr(Exception):
    """An NVMLError raised by pynvml in the child."""

    def __init__(self, code: int, cls: str, text: str) -> None:
        super().__init__(f"{cls}({code}): {text}")
        self.code, self.cls, self.text = code, cls, text


class NvmlProcess:
    """A child Python running the real pynvml against the fake library."""

    def __init__(self, fake: FakeNvml, tmp_path: Path) -> None:
        env = {**os.environ, **fake.env(), "PYTHONUNBUFFERED": "1"}
        self.stderr_path = tmp_path / f"child-{id(self)}.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(fake.library)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
            bufsize=1,
        )
        self.last_elapsed = 0.0

    def request(self, req: dict, timeout: float = 20.0) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"child did not answer {req} within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child died: {self.stderr_path.read_text()}")
        resp = json.loads(line)
        self.last_elapsed = resp["elapsed"]
        if "err" in resp:
            raise NvmlErr(resp["err"], resp["cls"], resp["str"])
        if "exc" in resp:
            raise RuntimeError(f"child raised {resp['exc']}: {resp['str']}\n{resp['tb']}")
        return resp["ok"]

    def call(self, name: str, *args: Any, timeout: float = 20.0) -> Any:
        return self.request({"call": name, "args": list(args)}, timeout)

    def exec(self, code: str, timeout: float = 20.0) -> Any:
        return self.request({"exec": textwrap.dedent(code)}, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    children: list[NvmlProcess] = []

    def _spawn(fake: FakeNvml, init: bool = True) -> NvmlProcess:
        p = NvmlProcess(fake, tmp_path)
        children.append(p)
        if init:
            p.call("nvmlInit")
        return p

    yield _spawn
    for p in children:
        p.close()


@pytest.fixture
def nvml(fake_nvml: FakeNvml, spawn) -> NvmlProcess:
    """An initialised child on the default 2-GPU fake."""
    return spawn(fake_nvml)


def H(i: int) -> dict:
    return {"h": i}


def raises(p: NvmlProcess, cls: str, name: str, *args: Any) -> NvmlErr:
    with pytest.raises(NvmlErr) as info:
        p.call(name, *args)
    assert info.value.cls == cls, info.value
    return info.value


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------


def test_build_werror_and_cache(tmp_path: Path) -> None:
    assert "-Werror" in CFLAGS and "-Wall" in CFLAGS and "-Wextra" in CFLAGS
    lib = build(tmp_path)
    assert lib == tmp_path / LIBRARY_NAME and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert build(tmp_path) == lib
    assert lib.stat().st_mtime_ns == mtime, "an up-to-date library must not be rebuilt"
    os.utime(lib, ns=(SOURCE.stat().st_mtime_ns - 10**9,) * 2)  # older than the source
    build(tmp_path)
    assert lib.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns
    # stricter warnings than the build uses stay clean too
    strict = subprocess.run(
        [
            "gcc",
            *CFLAGS,
            "-Wpedantic",
            "-Wshadow",
            "-Wconversion",
            "-o",
            str(tmp_path / "strict.so"),
            str(SOURCE),
        ],
        capture_output=True,
        text=True,
    )
    assert strict.returncode == 0, strict.stderr
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True
    ).stdout
    for sym in (
        "nvmlInitWithFlags",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlEventSetWait_v2",
        "fakenvml_call_count",
    ):
        assert f" {sym}\n" in symbols


def test_struct_sizes_match_pynvml() -> None:
    """The sizes the C library asserts statically equal pynvml's ctypes structures."""
    assert ctypes.sizeof(pynvml.nvmlPciInfo_t) == 68
    assert ctypes.sizeof(pynvml.c_nvmlUtilization_t) == 8
    assert ctypes.sizeof(pynvml.c_nvmlMemory_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) == 40
    assert ctypes.sizeof(pynvml.c_nvmlFieldValue_t) == 40
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t) == 32
    assert ctypes.sizeof(pynvml.c_nvmlEventData_t) == 32
    assert ctypes.sizeof(pynvml.c_nvmlViolationTime_t) == 16


# --------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------


def test_defaults_are_plausible(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    assert nvml.call("nvmlDeviceGetCount") == 2
    uuids = {nvml.call("nvmlDeviceGetUUID", H(i)) for i in range(2)}
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)
    assert nvml.call("nvmlDeviceGetName", H(0)) == "NVIDIA Fake A100"
    mem = nvml.call("nvmlDeviceGetMemoryInfo", H(0))
    assert mem["total"] == 80 * 1024**3
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(1))["gpu"] == 50
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 60
    assert nvml.call("nvmlDeviceGetPowerUsage", H(0)) == 250_000
    procs = nvml.call("nvmlDeviceGetComputeRunningProcesses", H(0)) + nvml.call(
        "nvmlDeviceGetComputeRunningProcesses", H(1)
    )
    assert sorted(p["pid"] for p in procs) == [1000, 1001, 1002, 1003]
    assert fake_nvml.gpus[0] == default_gpu(0)


def test_values_round_trip_in_nvml_units(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.set(driver_version="535.104.05", nvml_version="12.535.104.05")
    fake_nvml.gpu(
        1,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-12345678-aaaa-bbbb-cccc-0123456789ab",
        pci_bus_id="00000000:3B:00.0",
        pci_device_id=0x233010DE,
        utilization_gpu=87,
        utilization_memory=41,
        encoder_utilization=12,
        decoder_utilization=7,
        memory_total=85_520_809_984,
        memory_used=1_234_567_890,
        memory_free=83_000_000_000,
        memory_reserved=567_000_000,
        temperature=71,
        memory_temperature=83,
        power_usage=312_456,
        power_limit=700_000,
        total_energy=98_765_432_109,
        clock_graphics=1755,
        clock_sm=1980,
        clock_memory=2619,
        clock_video=1545,
        fan_speed=33,
        pcie_tx=123_456,
        pcie_rx=654_321,
        performance_state=2,
        clocks_event_reasons=0x40 | 0x4,
        ecc_corrected_volatile=5,
        ecc_uncorrected_volatile=1,
        ecc_corrected_aggregate=50,
        ecc_uncorrected_aggregate=10,
    )
    p = nvml
    h = H(1)
    assert p.call("nvmlSystemGetDriverVersion") == "535.104.05"
    assert p.call("nvmlSystemGetNVMLVersion") == "12.535.104.05"
    assert p.call("nvmlDeviceGetIndex", h) == 1
    assert p.call("nvmlDeviceGetName", h) == "NVIDIA H100 80GB HBM3"
    assert p.call("nvmlDeviceGetUUID", h) == "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"
    pci = p.call("nvmlDeviceGetPciInfo", h)
    assert pci["busId"] == "00000000:3B:00.0" and pci["busIdLegacy"] == "0000:3B:00.0"
    assert (pci["domain"], pci["bus"], pci["device"], pci["pciDeviceId"]) == (
        0,
        0x3B,
        0,
        0x233010DE,
    )
    assert p.call("nvmlDeviceGetUtilizationRates", h) == {"gpu": 87, "memory": 41}
    assert p.call("nvmlDeviceGetEncoderUtilization", h)[0] == 12
    assert p.call("nvmlDeviceGetDecoderUtilization", h)[0] == 7
    assert p.call("nvmlDeviceGetMemoryInfo", h) == {
        "total": 85_520_809_984,
        "free": 83_000_000_000,
        "used": 1_234_567_890,
    }
    assert p.call("nvmlDeviceGetTemperature", h, pynvml.NVML_TEMPERATURE_GPU) == 71
    fv = p.call("nvmlDeviceGetFieldValues", h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])[0]
    assert fv["nvmlReturn"] == 0 and fv["valueType"] == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert fv["value"]["uiVal"] == 83 and fv["timestamp"] > 0
    assert p.call("nvmlDeviceGetPowerUsage", h) == 312_456  # mW
    assert p.call("nvmlDeviceGetEnforcedPowerLimit", h) == 700_000  # mW
    assert p.call("nvmlDeviceGetTotalEnergyConsumption", h) == 98_765_432_109  # mJ
    assert p.call("nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_GRAPHICS) == 1755
    assert p.call("nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_SM) == 1980
    assert p.call("nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_MEM) == 2619
    assert p.call("nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_VIDEO) == 1545
    assert p.call("nvmlDeviceGetFanSpeed", h) == 33
    assert p.call("nvmlDeviceGetPcieThroughput", h, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 123_456
    assert p.call("nvmlDeviceGetPcieThroughput", h, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 654_321
    assert p.call("nvmlDeviceGetPerformanceState", h) == 2
    assert p.call("nvmlDeviceGetCurrentClocksEventReasons", h) == 0x44
    assert p.call("nvmlDeviceGetCurrentClocksThrottleReasons", h) == 0x44
    ecc = {(e, c): p.call("nvmlDeviceGetTotalEccErrors", h, e, c) for e in (0, 1) for c in (0, 1)}
    assert ecc == {(0, 0): 5, (1, 0): 1, (0, 1): 50, (1, 1): 10}
    # the other GPU kept its defaults
    assert p.call("nvmlDeviceGetUtilizationRates", H(0)) == {"gpu": 50, "memory": 30}
    # bad arguments are rejected as NVML does
    raises(p, "NVMLError_InvalidArgument", "nvmlDeviceGetTemperature", h, 1)
    raises(p, "NVMLError_InvalidArgument", "nvmlDeviceGetClockInfo", h, 7)
    raises(p, "NVMLError_InvalidArgument", "nvmlDeviceGetHandleByIndex", 2)


def test_garbage_values_pass_through(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(
        0,
        utilization_gpu=250,
        temperature=4294967295,
        power_usage=-1,
        performance_state=pynvml.NVML_PSTATE_UNKNOWN,
        memory_used=2**64 - 1,
        memory_free=0,
        memory_total=0,
    )
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == 250
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 4294967295
    assert nvml.call("nvmlDeviceGetPowerUsage", H(0)) == 4294967295  # -1 wraps like C
    assert nvml.call("nvmlDeviceGetPerformanceState", H(0)) == 32
    assert nvml.call("nvmlDeviceGetMemoryInfo", H(0)) == {"total": 0, "free": 0, "used": 2**64 - 1}


def test_memory_v2_and_fallback(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(0, memory_total=1000, memory_used=300, memory_free=600, memory_reserved=100)
    v2 = nvml.call("nvmlDeviceGetMemoryInfo", H(0), pynvml.nvmlMemory_v2)
    assert v2 == {
        "version": pynvml.nvmlMemory_v2,
        "total": 1000,
        "reserved": 100,
        "free": 600,
        "used": 300,
    }
    # a wrong struct version is refused like the real driver does
    assert (
        nvml.exec("""
        m = pynvml.c_nvmlMemory_v2_t(); m.version = 1
        result = pynvml.nvmlLib.nvmlDeviceGetMemoryInfo_v2(H(0), ctypes.byref(m))
    """)
        == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    )
    fake_nvml.gpu(0, memory_v2=False)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetMemoryInfo", H(0), pynvml.nvmlMemory_v2)
    assert nvml.call("nvmlDeviceGetMemoryInfo", H(0)) == {"total": 1000, "free": 600, "used": 300}
    # the other GPU still has v2
    assert (
        nvml.call("nvmlDeviceGetMemoryInfo", H(1), pynvml.nvmlMemory_v2)["version"]
        == pynvml.nvmlMemory_v2
    )


def test_runtime_change_is_seen_without_reinit(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == 50
    # same-size rewrites in quick succession (same mtime tick) must not be missed
    for value in (51, 52, 53, 54, 55, 56, 57, 58, 59):
        fake_nvml.gpu(0, utilization_gpu=value)
        assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == value
    fake_nvml.set(device_count=3)
    assert nvml.call("nvmlDeviceGetCount") == 3
    assert nvml.call("nvmlDeviceGetUUID", H(2)) == fake_nvml.gpus[2]["uuid"]
    # a config file older than a second is only stat()ed; a change is still seen
    time.sleep(1.2)
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == 59
    fake_nvml.gpu(0, utilization_gpu=60)
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == 60
    # the device went away -> its handle reports the GPU lost
    fake_nvml.set(device_count=1)
    raises(nvml, "NVMLError_GpuIsLost", "nvmlDeviceGetUUID", H(2))


def test_in_place_same_size_rewrites_are_seen(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """Same inode, same size, same mtime tick: still re-read (a young file is never trusted
    to stat())."""
    fake_nvml.gpu(0, temperature=70)
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 70
    text = fake_nvml.config.read_text()
    inode = fake_nvml.config.stat().st_ino
    for value in range(71, 80):
        with open(fake_nvml.config, "r+") as f:
            f.write(text.replace("gpu.0.temperature=70", f"gpu.0.temperature={value}"))
        assert fake_nvml.config.stat().st_ino == inode
        assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == value


def test_config_file_removed_keeps_last_values(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(0, temperature=77)
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 77
    fake_nvml.config.unlink()
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 77
    fake_nvml.gpu(0, temperature=78)
    assert nvml.call("nvmlDeviceGetTemperature", H(0), 0) == 78


def test_lost_gpu_fails_only_that_device(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    nvml.call("nvmlDeviceGetUUID", H(0))  # handles obtained before the loss
    nvml.call("nvmlDeviceGetUUID", H(1))
    fake_nvml.gpu(0, lost=True)
    for name, args in [
        ("nvmlDeviceGetUUID", ()),
        ("nvmlDeviceGetName", ()),
        ("nvmlDeviceGetUtilizationRates", ()),
        ("nvmlDeviceGetMemoryInfo", ()),
        ("nvmlDeviceGetTemperature", (0,)),
        ("nvmlDeviceGetPowerUsage", ()),
        ("nvmlDeviceGetTotalEnergyConsumption", ()),
        ("nvmlDeviceGetComputeRunningProcesses", ()),
        ("nvmlDeviceGetProcessUtilization", (0,)),
        ("nvmlDeviceGetIndex", ()),
    ]:
        err = raises(nvml, "NVMLError_GpuIsLost", name, H(0), *args)
        assert err.code == pynvml.NVML_ERROR_GPU_IS_LOST and err.text == "GPU is lost"
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(1))["gpu"] == 50
    assert nvml.call("nvmlDeviceGetCount") == 2
    # a new handle for the lost GPU cannot be had either (as nvidia-smi shows)
    assert (
        nvml.exec("""
        h = pynvml.c_nvmlDevice_t()
        result = pynvml.nvmlLib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
    """)
        == pynvml.NVML_ERROR_GPU_IS_LOST
    )
    fake_nvml.gpu(0, lost=False)
    assert nvml.call("nvmlDeviceGetUtilizationRates", H(0))["gpu"] == 50


def test_not_supported_fields(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(
        0,
        not_supported=[
            "fan_speed",
            "power_usage",
            "memory_temperature",
            "encoder_utilization",
            "clock_video",
            "ecc",
            "nvmlDeviceGetCurrentClocksEventReasons",
        ],
    )
    for name, args in [
        ("nvmlDeviceGetFanSpeed", ()),
        ("nvmlDeviceGetPowerUsage", ()),
        ("nvmlDeviceGetEncoderUtilization", ()),
        ("nvmlDeviceGetClockInfo", (pynvml.NVML_CLOCK_VIDEO,)),
        ("nvmlDeviceGetTotalEccErrors", (1, 0)),
        ("nvmlDeviceGetCurrentClocksEventReasons", ()),
    ]:
        err = raises(nvml, "NVMLError_NotSupported", name, H(0), *args)
        assert err.text == "Not Supported"
    # neighbours and the other GPU still work
    assert nvml.call("nvmlDeviceGetClockInfo", H(0), pynvml.NVML_CLOCK_SM) == 1410
    assert nvml.call("nvmlDeviceGetCurrentClocksThrottleReasons", H(0)) == 0
    assert nvml.call("nvmlDeviceGetFanSpeed", H(1)) == 40
    # per-value NOT_SUPPORTED in nvmlDeviceGetFieldValues; unknown ids too
    values = nvml.call("nvmlDeviceGetFieldValues", H(0), [pynvml.NVML_FI_DEV_MEMORY_TEMP, 1])
    assert [v["nvmlReturn"] for v in values] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 2
    values = nvml.call("nvmlDeviceGetFieldValues", H(1), [pynvml.NVML_FI_DEV_MEMORY_TEMP, 1])
    assert [v["nvmlReturn"] for v in values] == [0, pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert values[0]["value"]["uiVal"] == 70
    # arbitrary error codes per field or function
    fake_nvml.gpu(
        1, errors={"temperature": pynvml.NVML_ERROR_NO_PERMISSION, "nvmlDeviceGetName": 999}
    )
    raises(nvml, "NVMLError_NoPermission", "nvmlDeviceGetTemperature", H(1), 0)
    raises(nvml, "NVMLError_Unknown", "nvmlDeviceGetName", H(1))
    fake_nvml.gpu(0, not_supported=[])
    assert nvml.call("nvmlDeviceGetFanSpeed", H(0)) == 40


def test_a_gpu_that_answers_nothing(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    assert nvml.call("nvmlDeviceGetFanSpeed", H(1)) == 40
    fake_nvml.gpu(1, not_supported=["*"])
    for name, args in [
        ("nvmlDeviceGetFanSpeed", ()),
        ("nvmlDeviceGetMemoryInfo", ()),
        ("nvmlDeviceGetUUID", ()),
        ("nvmlDeviceGetFieldValues", ([pynvml.NVML_FI_DEV_MEMORY_TEMP],)),
    ]:
        raises(nvml, "NVMLError_NotSupported", name, H(1), *args)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetHandleByIndex", 1)
    assert nvml.call("nvmlDeviceGetFanSpeed", H(0)) == 40
    fake_nvml.gpu(1, not_supported=[])
    assert nvml.call("nvmlDeviceGetFanSpeed", H(1)) == 40


@pytest.mark.parametrize(
    "code,cls",
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVMLError_DriverNotLoaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVMLError_LibRmVersionMismatch"),
    ],
)
def test_init_error(fake_nvml: FakeNvml, spawn, code: int, cls: str) -> None:
    fake_nvml.set(init_error=code)
    p = spawn(fake_nvml, init=False)
    err = raises(p, cls, "nvmlInit")
    assert err.code == code
    raises(p, "NVMLError_Uninitialized", "nvmlDeviceGetCount")
    fake_nvml.set(init_error=0)  # the driver came back: a retry works
    p.call("nvmlInit")
    assert p.call("nvmlDeviceGetCount") == 2


def test_no_config_is_driver_not_loaded(fake_nvml: FakeNvml, spawn) -> None:
    fake_nvml.config.unlink()
    p = spawn(fake_nvml, init=False)
    raises(p, "NVMLError_DriverNotLoaded", "nvmlInit")


def test_init_refcount_and_shutdown(nvml: NvmlProcess) -> None:
    nvml.call("nvmlInit")  # refcount 2
    nvml.call("nvmlShutdown")
    assert nvml.call("nvmlDeviceGetCount") == 2
    nvml.call("nvmlShutdown")
    raises(nvml, "NVMLError_Uninitialized", "nvmlDeviceGetCount")
    raises(nvml, "NVMLError_Uninitialized", "nvmlShutdown")


def test_fail_all(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    assert nvml.call("nvmlDeviceGetCount") == 2
    nvml.call("nvmlDeviceGetUUID", H(1))
    fake_nvml.set(fail_all=pynvml.NVML_ERROR_UNKNOWN)
    for name, args in [
        ("nvmlDeviceGetCount", ()),
        ("nvmlSystemGetDriverVersion", ()),
        ("nvmlDeviceGetHandleByIndex", (0,)),
        ("nvmlDeviceGetUtilizationRates", (H(1),)),
        ("nvmlDeviceGetMemoryInfo", (H(1),)),
        ("nvmlEventSetCreate", ()),
    ]:
        err = raises(nvml, "NVMLError_Unknown", name, *args)
        assert err.text == "Unknown Error"
    assert nvml.call("nvmlErrorString", pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    fake_nvml.set(fail_all=pynvml.NVML_ERROR_GPU_IS_LOST)
    raises(nvml, "NVMLError_GpuIsLost", "nvmlDeviceGetCount")
    fake_nvml.set(fail_all=0)
    assert nvml.call("nvmlDeviceGetCount") == 2
    nvml.call("nvmlShutdown")  # shutdown is never failed by fail_all


def test_global_errors_by_function(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.set(errors={"nvmlSystemGetDriverVersion": pynvml.NVML_ERROR_NOT_SUPPORTED})
    raises(nvml, "NVMLError_NotSupported", "nvmlSystemGetDriverVersion")
    assert nvml.call("nvmlSystemGetNVMLVersion") == "12.550.54.15"


def test_error_strings(nvml: NvmlProcess) -> None:
    expected = {
        0: "Success",
        1: "Uninitialized",
        3: "Not Supported",
        9: "Driver Not Loaded",
        10: "Timeout",
        15: "GPU is lost",
        18: "RM has detected an NVML/RM version mismatch.",
        999: "Unknown Error",
        12345: "Unknown Error",
    }
    for code, text in expected.items():
        assert nvml.call("nvmlErrorString", code) == text


def test_unlisted_functions_are_not_found(nvml: NvmlProcess) -> None:
    raises(nvml, "NVMLError_FunctionNotFound", "nvmlDeviceGetPowerManagementLimit", H(0))


def test_delay_ms(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    nvml.call("nvmlDeviceGetUUID", H(0))
    nvml.call("nvmlDeviceGetUUID", H(1))
    fake_nvml.set(delay_ms=300)
    nvml.call("nvmlDeviceGetPowerUsage", H(0))
    assert nvml.last_elapsed >= 0.3
    raises(nvml, "NVMLError_InvalidArgument", "nvmlDeviceGetTemperature", H(0), 5)
    assert nvml.last_elapsed >= 0.3  # failing calls are slow too
    fake_nvml.set(delay_ms=0)
    fake_nvml.gpu(1, delay_ms=2000)  # one slow GPU
    nvml.call("nvmlDeviceGetPowerUsage", H(0))
    assert nvml.last_elapsed < 1.0  # not the other GPU's 2 s
    nvml.call("nvmlDeviceGetPowerUsage", H(1))
    assert nvml.last_elapsed >= 2.0


def test_pcie_throughput_ms(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """The PCIe throughput call alone measures for its window, as NVML's does; a failing one
    answers at once."""
    nvml.call("nvmlDeviceGetUUID", H(0))
    fake_nvml.set(pcie_throughput_ms=300)
    nvml.call("nvmlDeviceGetPcieThroughput", H(0), pynvml.NVML_PCIE_UTIL_TX_BYTES)
    assert nvml.last_elapsed >= 0.3
    nvml.call("nvmlDeviceGetPowerUsage", H(0))
    assert nvml.last_elapsed < 0.3
    raises(nvml, "NVMLError_InvalidArgument", "nvmlDeviceGetPcieThroughput", H(0), 7)
    assert nvml.last_elapsed < 0.3


def test_delay_does_not_block_other_threads(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """A slow call in one thread must not serialise the others (the lock is not held
    while sleeping)."""
    nvml.call("nvmlDeviceGetUUID", H(0))
    fake_nvml.set(delay_ms=1000)
    elapsed = nvml.exec("""
        import threading
        t0 = time.monotonic()
        ts = [
            threading.Thread(target=pynvml.nvmlDeviceGetPowerUsage, args=(H(0),))
            for _ in range(4)
        ]
        [t.start() for t in ts]; [t.join() for t in ts]
        result = time.monotonic() - t0
    """)
    assert 1.0 <= elapsed < 3.0  # four calls in series would take 4 s


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------


def test_running_processes(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    procs = nvml.call("nvmlDeviceGetComputeRunningProcesses", H(0))
    assert [(p["pid"], p["usedGpuMemory"]) for p in procs] == [(1000, 1024**3), (1001, 2 * 1024**3)]
    assert procs[0]["gpuInstanceId"] == 0xFFFFFFFF
    assert nvml.call("nvmlDeviceGetGraphicsRunningProcesses", H(0)) == []
    fake_nvml.processes(
        1,
        [
            {
                "pid": 4242,
                "used_memory": 5 * 1024**2,
                "sm_util": 90,
                "mem_util": 40,
                "type": "compute",
            },
            {"pid": 4343, "used_memory": 2**64 - 1, "type": "graphics"},
            {"pid": 4444, "used_memory": 7, "type": "both"},
        ]
        + [{"pid": 5000 + n, "used_memory": n} for n in range(40)],
    )  # more than pynvml's first guess
    compute = nvml.call("nvmlDeviceGetComputeRunningProcesses", H(1))
    assert [p["pid"] for p in compute] == [4242, 4444] + [5000 + n for n in range(40)]
    assert compute[0]["usedGpuMemory"] == 5 * 1024**2
    graphics = nvml.call("nvmlDeviceGetGraphicsRunningProcesses", H(1))
    assert [(p["pid"], p["usedGpuMemory"]) for p in graphics] == [
        (4343, None),
        (4444, 7),
    ]  # N/A -> None
    fake_nvml.processes(1, [])
    assert nvml.call("nvmlDeviceGetComputeRunningProcesses", H(1)) == []
    # the INSUFFICIENT_SIZE protocol at the C level
    assert nvml.exec("""
        n = ctypes.c_uint(0)
        rc1 = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(H(0), ctypes.byref(n), None)
        first = n.value
        arr = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
        n.value = 1
        rc2 = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(H(0), ctypes.byref(n), arr)
        result = [rc1, first, rc2, n.value]
    """) == [pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 2, pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 2]


def test_process_utilization(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    before = int(time.time() * 1e6)
    samples = nvml.call("nvmlDeviceGetProcessUtilization", H(0), 0)
    assert [(s["pid"], s["smUtil"], s["memUtil"]) for s in samples] == [
        (1000, 20, 10),
        (1001, 30, 15),
    ]
    assert all(s["timeStamp"] >= before for s in samples)  # timestamp 0 = a fresh sample every call
    last = max(s["timeStamp"] for s in samples)
    assert nvml.call("nvmlDeviceGetProcessUtilization", H(0), last)  # still fresh later
    fake_nvml.processes(
        0,
        [
            {
                "pid": 7,
                "sm_util": 11,
                "mem_util": 12,
                "enc_util": 13,
                "dec_util": 14,
                "timestamp": 1_000_000,
            },
            {"pid": 8, "sm_util": 21, "timestamp": 2_000_000},
        ],
    )
    samples = nvml.call("nvmlDeviceGetProcessUtilization", H(0), 0)
    assert [
        (s["pid"], s["timeStamp"], s["smUtil"], s["memUtil"], s["encUtil"], s["decUtil"])
        for s in samples
    ] == [(7, 1_000_000, 11, 12, 13, 14), (8, 2_000_000, 21, 0, 0, 0)]
    assert [s["pid"] for s in nvml.call("nvmlDeviceGetProcessUtilization", H(0), 1_000_000)] == [8]
    raises(nvml, "NVMLError_NotFound", "nvmlDeviceGetProcessUtilization", H(0), 2_000_000)
    fake_nvml.processes(0, [])
    raises(nvml, "NVMLError_NotFound", "nvmlDeviceGetProcessUtilization", H(0), 0)
    fake_nvml.gpu(1, not_supported=["process_utilization"])
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetProcessUtilization", H(1), 0)


# --------------------------------------------------------------------------
# XID events
# --------------------------------------------------------------------------


def test_xid_events_in_order_once_and_timeout(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.add_xid(0, 13)  # before the set exists: never delivered
    assert (
        nvml.call("nvmlDeviceGetSupportedEventTypes", H(0)) & pynvml.nvmlEventTypeXidCriticalError
    )
    es = nvml.call("nvmlEventSetCreate")
    nvml.call("nvmlDeviceRegisterEvents", H(0), pynvml.nvmlEventTypeXidCriticalError, es)
    nvml.call("nvmlDeviceRegisterEvents", H(1), pynvml.nvmlEventTypeXidCriticalError, es)
    err = raises(nvml, "NVMLError_Timeout", "nvmlEventSetWait", es, 100)
    assert err.text == "Timeout" and nvml.last_elapsed >= 0.09
    for gpu, xid in [(0, 79), (1, 48), (0, 31)]:
        fake_nvml.add_xid(gpu, xid)
    h0 = nvml.exec("result = addr(H(0))")
    h1 = nvml.exec("result = addr(H(1))")
    got = []
    for _ in range(3):
        ev = nvml.call("nvmlEventSetWait", es, 1000)
        assert ev["eventType"] == pynvml.nvmlEventTypeXidCriticalError
        assert ev["gpuInstanceId"] == 0xFFFFFFFF
        got.append(({h0: 0, h1: 1}[ev["device"]["addr"]], ev["eventData"]))
    assert got == [(0, 79), (1, 48), (0, 31)]
    raises(nvml, "NVMLError_Timeout", "nvmlEventSetWait", es, 50)  # each delivered once
    # a second set sees only events appended after its creation
    es2 = nvml.call("nvmlEventSetCreate")
    nvml.call("nvmlDeviceRegisterEvents", H(1), pynvml.nvmlEventTypeXidCriticalError, es2)
    fake_nvml.add_xid(0, 94)  # GPU 0: not registered in es2
    fake_nvml.add_xid(1, 63)
    assert nvml.call("nvmlEventSetWait", es2, 1000)["eventData"] == 63
    assert nvml.call("nvmlEventSetWait", es, 1000)["eventData"] == 94
    assert nvml.call("nvmlEventSetWait", es, 1000)["eventData"] == 63
    raises(nvml, "NVMLError_Timeout", "nvmlEventSetWait", es2, 0)
    nvml.call("nvmlEventSetFree", es2)
    nvml.call("nvmlEventSetFree", es)
    raises(nvml, "NVMLError_InvalidArgument", "nvmlEventSetFree", es)


def test_xid_event_wakes_a_blocked_waiter(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """An event thread blocks in nvmlEventSetWait_v2 while another thread samples."""
    nvml.exec("""
        import threading
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(H(1), pynvml.nvmlEventTypeXidCriticalError, es)
        events, samples = [], []
        def waiter():
            t0 = time.monotonic()
            while len(events) < 2 and time.monotonic() - t0 < 15:
                try:
                    d = pynvml.nvmlEventSetWait(es, 5000)
                    index = pynvml.nvmlDeviceGetIndex(d.device)
                    events.append((index, d.eventData, time.monotonic()))
                except pynvml.NVMLError_Timeout:
                    pass
        def sampler():
            while len(events) < 2:
                samples.append(pynvml.nvmlDeviceGetUtilizationRates(H(0)).gpu)
                time.sleep(0.01)
        threads = [threading.Thread(target=waiter), threading.Thread(target=sampler)]
        [t.start() for t in threads]
    """)
    time.sleep(0.3)
    sent = time.monotonic()
    fake_nvml.add_xid(1, 79)
    fake_nvml.add_xid(1, 119)
    result = nvml.exec("""
        [t.join() for t in threads]
        result = {"events": [e[:2] for e in events], "samples": len(samples), "first": events[0][2]}
    """)
    assert result["events"] == [[1, 79], [1, 119]]
    assert result["samples"] > 5, "the sampler thread must keep running while the waiter blocks"
    assert result["first"] - sent < 2.0  # woke up promptly, long before its 5 s timeout


def test_event_wait_ends_on_shutdown_and_fail_all(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    nvml.exec("""
        import threading
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(H(0), pynvml.nvmlEventTypeXidCriticalError, es)
        outcome = []
        def waiter():
            try:
                pynvml.nvmlEventSetWait(es, 10000)
                outcome.append("event")
            except pynvml.NVMLError as e:
                outcome.append(type(e).__name__)
        t = threading.Thread(target=waiter); t.start()
    """)
    fake_nvml.set(fail_all=pynvml.NVML_ERROR_GPU_IS_LOST)
    assert nvml.exec("t.join(5); result = outcome") == ["NVMLError_GpuIsLost"]
    fake_nvml.set(fail_all=0)
    assert nvml.exec("""
        t = threading.Thread(target=waiter); t.start(); time.sleep(0.1)
        pynvml.nvmlShutdown()
        t.join(5)
        result = outcome
    """) == ["NVMLError_GpuIsLost", "NVMLError_Uninitialized"]


def test_register_unsupported_event_type(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(0, supported_event_types=pynvml.nvmlEventTypeXidCriticalError)
    es = nvml.call("nvmlEventSetCreate")
    raises(
        nvml,
        "NVMLError_NotSupported",
        "nvmlDeviceRegisterEvents",
        H(0),
        pynvml.nvmlEventTypePState,
        es,
    )
    fake_nvml.gpu(1, not_supported=["events"])
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetSupportedEventTypes", H(1))
    raises(
        nvml,
        "NVMLError_NotSupported",
        "nvmlDeviceRegisterEvents",
        H(1),
        pynvml.nvmlEventTypeXidCriticalError,
        es,
    )


def test_event_wait_answers_gpu_is_lost_while_a_gpu_of_its_set_is(
    fake_nvml: FakeNvml, nvml: NvmlProcess
) -> None:
    """A set with a lost GPU registered gives the events from before the loss, then answers
    every wait GPU_IS_LOST, naming no GPU, while later events wait; a set without that GPU goes
    on. A GPU's own error for the wait acts alike, at once."""
    xid = pynvml.nvmlEventTypeXidCriticalError
    both, first = nvml.call("nvmlEventSetCreate"), nvml.call("nvmlEventSetCreate")
    for handle, event_set in ((H(0), both), (H(1), both), (H(0), first)):
        nvml.call("nvmlDeviceRegisterEvents", handle, xid, event_set)
    fake_nvml.add_xid(0, 48)
    fake_nvml.gpu(1, lost=True)
    raises(nvml, "NVMLError_GpuIsLost", "nvmlDeviceGetUUID", H(1))  # the loss seen
    fake_nvml.add_xid(0, 79)
    assert nvml.call("nvmlEventSetWait", both, 0)["eventData"] == 48
    raises(nvml, "NVMLError_GpuIsLost", "nvmlEventSetWait", both, 0)
    raises(nvml, "NVMLError_GpuIsLost", "nvmlEventSetWait", both, 50)
    assert [nvml.call("nvmlEventSetWait", first, 1000)["eventData"] for _ in "ab"] == [48, 79]
    fake_nvml.gpu(1, lost=False, errors={"nvmlEventSetWait_v2": pynvml.NVML_ERROR_UNKNOWN})
    raises(nvml, "NVMLError_Unknown", "nvmlEventSetWait", both, 0)
    fake_nvml.gpu(1, errors={})
    assert nvml.call("nvmlEventSetWait", both, 1000)["eventData"] == 79  # kept meanwhile
    fake_nvml.set(device_count=1)  # GPU 1 gone
    raises(nvml, "NVMLError_GpuIsLost", "nvmlEventSetWait", both, 0)


# --------------------------------------------------------------------------
# GPM
# --------------------------------------------------------------------------

GPM_PAIR = textwrap.dedent("""
    def pair(i, pause):
        s1, s2 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(H(i), s1)
        time.sleep(pause)
        pynvml.nvmlGpmSampleGet(H(i), s2)
        return s1, s2

    def metrics(s1, s2, ids):
        get = pynvml.c_nvmlGpmMetricsGet_t()
        get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(ids)
        get.sample1, get.sample2 = s1, s2
        for n, metric in enumerate(ids):
            get.metrics[n].metricId = metric
        pynvml.nvmlGpmMetricsGet(get)
        return {
            m.metricId: [m.nvmlReturn, m.value, m.metricInfo.unit.decode()]
            for m in get.metrics[: len(ids)]
        }
""")


def test_gpm_struct_layouts_match_pynvml() -> None:
    assert ctypes.sizeof(pynvml.c_nvmlGpmMetric_t) == 40
    assert pynvml.c_nvmlGpmMetricsGet_t.metrics.offset == 24
    assert ctypes.sizeof(pynvml.c_nvmlGpmSupport_t) == 8


def test_gpm_metrics_between_two_samples_are_the_configured_rates(
    fake_nvml: FakeNvml, nvml: NvmlProcess
) -> None:
    sm, pcie, tensor = (
        pynvml.NVML_GPM_METRIC_SM_UTIL,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    )
    fake_nvml.gpu(
        0, gpm_supported=True, gpm_metrics={sm: 42.5, pcie: 1000}, gpm_not_supported=[tensor]
    )
    assert nvml.call("nvmlGpmQueryDeviceSupport", H(0))["isSupportedDevice"] == 1
    assert nvml.call("nvmlGpmQueryDeviceSupport", H(1))["isSupportedDevice"] == 0
    nvml.exec(GPM_PAIR)
    found = nvml.exec(
        f"s1, s2 = pair(0, 0.2); result = metrics(s1, s2, [{sm}, {pcie}, {tensor}, 1])"
    )
    assert found[str(sm)][:1] == [0] and found[str(sm)][1] == pytest.approx(42.5)
    assert found[str(pcie)][1:] == [pytest.approx(1000), "MiB/sec"]
    assert found[str(tensor)][0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert found["1"] == [0, 0.0, "%"]  # a metric with no configured rate: an idle GPU
    # A rate changed between samples counts from the GPU's previous sample.
    fake_nvml.gpu(0, gpm_metrics={sm: 10.0})
    again = nvml.exec(f"s3, s4 = pair(0, 0.1); result = metrics(s3, s4, [{sm}])")
    assert again[str(sm)][1] == pytest.approx(10.0)
    nvml.exec("[pynvml.nvmlGpmSampleFree(s) for s in (s1, s2, s3, s4)]")
    calls = fake_nvml.calls()
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] == 4
    assert calls["nvmlGpmSampleGet"] == 4 and calls["nvmlGpmMetricsGet"] == 2


def test_gpm_faults(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(0, gpm_supported=True)
    fake_nvml.gpu(1, gpm_supported=True)
    nvml.exec(GPM_PAIR + "\ns = pynvml.nvmlGpmSampleAlloc()")
    unsupported = "pynvml.nvmlGpmSampleGet(H(0), s)"
    fake_nvml.gpu(0, gpm_supported=False)
    with pytest.raises(NvmlErr, match="NotSupported"):
        nvml.exec(unsupported)
    fake_nvml.gpu(0, gpm_supported=True, errors={"nvmlGpmSampleGet": 999})
    with pytest.raises(NvmlErr, match="Unknown"):
        nvml.exec(unsupported)
    fake_nvml.gpu(0, errors={}, lost=True)
    with pytest.raises(NvmlErr, match="GpuIsLost"):
        nvml.exec(unsupported)
    fake_nvml.gpu(0, lost=False, not_supported=["gpm"])
    raises(nvml, "NVMLError_NotSupported", "nvmlGpmQueryDeviceSupport", H(0))
    fake_nvml.gpu(0, not_supported=[])
    # Samples of two GPUs, or one not taken yet, make no pair.
    mixed = "a, _ = pair(0, 0.01); b, _ = pair(1, 0.01); metrics(a, b, [1])"
    with pytest.raises(NvmlErr, match="InvalidArgument"):
        nvml.exec(mixed)
    with pytest.raises(NvmlErr, match="InvalidArgument"):
        nvml.exec("metrics(a, pynvml.nvmlGpmSampleAlloc(), [1])")
    nvml.exec("pynvml.nvmlGpmSampleFree(s)")
    with pytest.raises(NvmlErr, match="InvalidArgument"):
        nvml.exec("pynvml.nvmlGpmSampleFree(s)")  # twice


# --------------------------------------------------------------------------
# call counts and thread safety
# --------------------------------------------------------------------------


def test_stats_counts(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(0, not_supported=["fan_speed"])
    for _ in range(5):
        with pytest.raises(NvmlErr):
            nvml.call("nvmlDeviceGetFanSpeed", H(0))
    for _ in range(3):
        nvml.call("nvmlDeviceGetFanSpeed", H(1))
    nvml.call("nvmlDeviceGetPowerUsage", H(0))
    calls = fake_nvml.calls()  # written by the child on every call
    assert calls["nvmlInitWithFlags"] == 1
    assert calls["nvmlDeviceGetFanSpeed"] == 8  # failed calls count too
    assert calls["nvmlDeviceGetHandleByIndex_v2"] == 2
    assert calls["nvmlDeviceGetPowerUsage"] == 1
    assert calls["nvmlDeviceGetTemperature"] == 0  # Counter: never called -> 0
    # the same numbers through the exported counter, in-process
    assert (
        nvml.exec("""
        f = pynvml.nvmlLib.fakenvml_call_count
        f.restype = ctypes.c_ulonglong
        result = f(b"nvmlDeviceGetFanSpeed")
    """)
        == 8
    )
    nvml.exec("pynvml.nvmlLib.fakenvml_reset_counts()")
    assert fake_nvml.calls()["nvmlDeviceGetFanSpeed"] == 0


def test_stats_bursts_are_flushed(fake_nvml: FakeNvml, nvml: NvmlProcess, spawn) -> None:
    """Writes are throttled to one per 50 ms; a flusher thread and the exit write the rest."""
    nvml.exec("[pynvml.nvmlDeviceGetTemperature(H(0), 0) for _ in range(2000)]")
    assert fake_nvml.calls()["nvmlDeviceGetTemperature"] == 2000
    nvml.exec("[pynvml.nvmlDeviceGetPowerUsage(H(0)) for _ in range(7)]")
    nvml.close()  # exits within 50 ms of the last write: the library writes at exit
    assert fake_nvml.calls(settle=0)["nvmlDeviceGetPowerUsage"] == 7


def test_fork_after_use_does_not_deadlock(nvml: NvmlProcess) -> None:
    assert nvml.exec(
        """
        import os
        pynvml.nvmlDeviceGetTemperature(H(0), 0)
        pid = os.fork()
        if pid == 0:
            try:
                for _ in range(100):
                    pynvml.nvmlDeviceGetTemperature(H(0), 0)
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        result = [status, pynvml.nvmlDeviceGetTemperature(H(0), 0)]
    """,
        timeout=20,
    ) == [0, 60]


def test_stats_path_can_be_chosen(fakenvml_lib: Path, tmp_path: Path, spawn) -> None:
    fake = FakeNvml(fakenvml_lib, tmp_path / "c.conf", gpus=1, stats=tmp_path / "counts.txt")
    assert fake.env() == {
        "FAKE_NVML_CONFIG": str(tmp_path / "c.conf"),
        "FAKE_NVML_STATS": str(tmp_path / "counts.txt"),
    }
    assert fake.calls() == {}
    p = spawn(fake)
    p.call("nvmlDeviceGetCount")
    assert (tmp_path / "counts.txt").exists()
    assert fake.calls()["nvmlDeviceGetCount_v2"] == 1


def test_concurrent_calls_while_config_changes(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """Several threads call while the config is rewritten: no crash, never a torn config."""
    fake_nvml.gpu(0, utilization_gpu=0, utilization_memory=0)
    nvml.exec("""
        import threading
        stop = False
        seen, bad, errors = set(), [], []
        def work():
            h = H(0)
            while not stop:
                try:
                    u = pynvml.nvmlDeviceGetUtilizationRates(h)
                    if u.gpu != u.memory:
                        bad.append((u.gpu, u.memory))
                    seen.add(u.gpu)
                    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                except pynvml.NVMLError as e:
                    errors.append(str(e))
        threads = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in threads]
    """)
    for i in range(200):
        fake_nvml.gpu(0, utilization_gpu=i, utilization_memory=i)
        if i % 20 == 0:
            fake_nvml.processes(0, [{"pid": 1 + n} for n in range(i % 7)])
    time.sleep(0.05)
    result = nvml.exec("""
        stop = True
        [t.join() for t in threads]
        result = {"bad": bad[:5], "errors": errors[:5], "seen": len(seen), "last": max(seen)}
    """)
    assert result["bad"] == [] and result["errors"] == []
    assert result["seen"] > 1 and result["last"] == 199


# --------------------------------------------------------------------------
# reliability and links
# --------------------------------------------------------------------------


def test_nvlinks_per_link(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(
        0,
        nvlink_count=3,
        nvlink_down=[1],
        nvlink_tx_kib=[100, 200, 2**40],
        nvlink_rx_kib=[7],
        nvlink_replay=[1, 2, 3],
        nvlink_recovery=[0, 0, 4],
        nvlink_crc_flit=[5],
        nvlink_crc_data=[0, 6],
    )
    h = H(0)
    count = nvml.call("nvmlDeviceGetFieldValues", h, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
    assert count["nvmlReturn"] == 0 and count["value"]["uiVal"] == 3
    assert [nvml.call("nvmlDeviceGetNvLinkState", h, link) for link in range(3)] == [1, 0, 1]
    raises(nvml, "NVMLError_InvalidArgument", "nvmlDeviceGetNvLinkState", h, 3)
    tx, rx = (
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    )
    ids = [[field, link] for link in range(4) for field in (tx, rx)]
    values = nvml.call("nvmlDeviceGetFieldValues", h, ids)
    assert [(v["fieldId"], v["scopeId"]) for v in values] == [tuple(i) for i in ids]
    assert [v["value"]["ullVal"] for v in values[:6]] == [100, 7, 200, 0, 2**40, 0]
    assert all(v["valueType"] == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG for v in values)
    assert [v["nvmlReturn"] for v in values] == [0] * 6 + [pynvml.NVML_ERROR_INVALID_ARGUMENT] * 2
    counters = {
        (link, counter): nvml.call("nvmlDeviceGetNvLinkErrorCounter", h, link, counter)
        for link in range(3)
        for counter in range(4)
    }
    assert [counters[link, pynvml.NVML_NVLINK_ERROR_DL_REPLAY] for link in range(3)] == [1, 2, 3]
    assert counters[2, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY] == 4
    assert counters[0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT] == 5
    assert counters[1, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA] == 6
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetNvLinkErrorCounter", h, 0, 4)
    # the other GPU has no NVLink
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetNvLinkState", H(1), 0)
    count = nvml.call("nvmlDeviceGetFieldValues", H(1), [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
    assert count["nvmlReturn"] == pynvml.NVML_ERROR_NOT_SUPPORTED
    # a link going down, and injected faults
    fake_nvml.gpu(0, nvlink_down=[0, 2], not_supported=["nvlink_errors", "nvlink_tx_kib"])
    assert [nvml.call("nvmlDeviceGetNvLinkState", h, link) for link in range(3)] == [0, 1, 0]
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetNvLinkErrorCounter", h, 0, 0)
    values = nvml.call("nvmlDeviceGetFieldValues", h, [[tx, 0], [rx, 0]])
    assert [v["nvmlReturn"] for v in values] == [pynvml.NVML_ERROR_NOT_SUPPORTED, 0]
    fake_nvml.gpu(0, not_supported=["nvlink"])
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetNvLinkState", h, 0)


def test_reliability_counters(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    fake_nvml.gpu(
        0,
        remapped_rows_correctable=3,
        remapped_rows_uncorrectable=1,
        remapped_rows_pending=1,
        remapped_rows_failure=0,
        retired_pages_single_bit=2,
        retired_pages_double_bit=5,
        retired_pages_pending=1,
        pcie_replay_counter=42,
        violation_power=1_500_000_000,
        violation_thermal=2,
        violation_sync_boost=3,
        violation_board_limit=4,
        violation_low_utilization=5,
        violation_reliability=6,
    )
    h = H(0)
    assert nvml.call("nvmlDeviceGetRemappedRows", h) == [3, 1, 1, 0]
    single = nvml.call(
        "nvmlDeviceGetRetiredPages",
        h,
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    )
    double = nvml.call(
        "nvmlDeviceGetRetiredPages", h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    assert len(single) == 2 and len(double) == 5 and not set(single) & set(double)
    assert nvml.call("nvmlDeviceGetRetiredPages", H(1), 0) == []
    assert nvml.call("nvmlDeviceGetRetiredPagesPendingStatus", h) == pynvml.NVML_FEATURE_ENABLED
    assert nvml.call("nvmlDeviceGetPcieReplayCounter", h) == 42
    policies = (
        pynvml.NVML_PERF_POLICY_POWER,
        pynvml.NVML_PERF_POLICY_THERMAL,
        pynvml.NVML_PERF_POLICY_SYNC_BOOST,
        pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
        pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
        pynvml.NVML_PERF_POLICY_RELIABILITY,
    )
    times = [nvml.call("nvmlDeviceGetViolationStatus", h, policy) for policy in policies]
    assert [t["violationTime"] for t in times] == [1_500_000_000, 2, 3, 4, 5, 6]
    assert all(t["referenceTime"] > 1_600_000_000 * 10**6 for t in times)  # µs since the epoch
    raises(
        nvml,
        "NVMLError_NotSupported",
        "nvmlDeviceGetViolationStatus",
        h,
        pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    )
    fake_nvml.gpu(
        0,
        not_supported=[
            "remapped_rows",
            "retired_pages",
            "pcie_replay_counter",
            "violation_thermal",
        ],
    )
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetRemappedRows", h)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetRetiredPages", h, 0)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetRetiredPagesPendingStatus", h)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetPcieReplayCounter", h)
    raises(nvml, "NVMLError_NotSupported", "nvmlDeviceGetViolationStatus", h, 1)
    assert nvml.call("nvmlDeviceGetViolationStatus", h, 0)["violationTime"] == 1_500_000_000


def test_event_wait_sleeps_instead_of_polling(fake_nvml: FakeNvml, nvml: NvmlProcess) -> None:
    """A thread waiting for events is switched out about once, not at every poll of the config:
    the fake must not charge a benchmark's agent CPU time a real driver would not."""
    result = nvml.exec("""
        import threading
        es = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(H(0), pynvml.nvmlEventTypeXidCriticalError, es)
        def switches():
            path = f"/proc/self/task/{threading.get_native_id()}/status"
            with open(path) as status:
                line = next(l for l in status if l.startswith("voluntary_ctxt_switches"))
            return int(line.split()[1])
        before = switches()
        try:
            pynvml.nvmlEventSetWait(es, 900)
        except pynvml.NVMLError_Timeout:
            pass
        result = switches() - before
    """)
    # Polling every 50 ms switched out 18 times; sleeping, about once (a loaded machine adds a few).
    assert result <= 9
