"""A driver that answers oddly on one GPU, through the real pynvml binding against the fake
libnvidia-ml.so.1: the other GPUs are read as ever, and the odd one as far as it can be."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from fakenvml import FakeNvml

NO_PERMISSION = 4
UNKNOWN = 999
NOT_AVAILABLE_UINT = 2**32 - 1
NOT_AVAILABLE_ULONGLONG = 2**64 - 1

# Run in a process of its own (pynvml's state is per process), `setup` between the two parts:
# `fake` (2 GPUs, 2 processes each) to set up, then `source` (an NvmlSource at a 0.2 s interval and
# a 1 s re-probe, started) and `read()` (a reading's GPUs as plain data) for `body`.
FAKE = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from fakenvml import FakeNvml
from kepler_bridge import config
from kepler_bridge.sources.nvml.source import NvmlSource

fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[3]), gpus=2, processes_per_gpu=2)
"""
SOURCE = """
settings = {"nvml_library": sys.argv[1], "interval": "0.2s", "nvml_reprobe_interval": "1s"}
source = NvmlSource(config.load(settings, {}))
source.start()

def read():
    return [
        {"up": gpu.up, "model": gpu.model, "uuid": gpu.uuid, "power": gpu.power_watts,
         "xids": gpu.xid_errors, "pcie_replays": gpu.pcie_replays,
         "rows": [gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable],
         "clock_events": dict(gpu.clock_event_seconds), "sm_active": gpu.sm_active,
         "mig": [[m.gpu_instance, m.profile, m.memory_total_bytes is not None, list(m.pids)]
                 for m in gpu.mig_instances]}
        for gpu in source.read().gpus
    ]
"""


def run(fake: FakeNvml, setup: str, body: str) -> tuple[Any, str]:
    """What `body` prints (JSON), run on `fake`'s library after `setup`."""
    script = FAKE + textwrap.dedent(setup) + SOURCE + textwrap.dedent(body) + "\nsource.stop()\n"
    return fake.printed(script, str(Path(__file__).parent), str(fake.config))


def test_a_gpu_whose_name_and_uuid_are_not_utf8_is_read_with_the_others(
    fake_nvml: FakeNvml,
) -> None:
    """pynvml's wrappers decode NVML's text strictly: bytes that are not UTF-8 (a garbled driver)
    are replaced, and neither that GPU nor any other goes down for them."""
    setup = """
        fake.set(driver_version="550.\\udcff")
        fake.gpu(1, name="NVIDIA \\udcff\\udcfe", uuid="GPU-\\udcff1")
    """
    found, stderr = run(fake_nvml, setup, "print(json.dumps([read(), source.driver_version]))")
    gpus, driver = found
    assert [gpu["up"] for gpu in gpus] == [True, True], stderr
    assert [gpu["power"] is not None for gpu in gpus] == [True, True], gpus
    assert gpus[1]["model"] == "NVIDIA \ufffd\ufffd" and gpus[1]["uuid"] == "GPU-\ufffd1"
    assert driver == "550.\ufffd"


@pytest.mark.parametrize("code", [NO_PERMISSION, UNKNOWN])
def test_gpm_refused_or_failing_leaves_the_gpu_read_without_profiling(
    fake_nvml: FakeNvml, code: int
) -> None:
    """Profiling is an extra: GPM refused (the driver gives it to administrators only) or failing
    at a GPU's acquire leaves that GPU up without its profiling metrics, `doctor` says why, and it
    is asked again: once GPM answers, they come."""
    setup = f"""
        fake.gpu(0, gpm_supported=True)
        fake.gpu(1, gpm_supported=True, errors={{"nvmlGpmQueryDeviceSupport": {code}}})
    """
    body = """
        said = [[read(), source.describe(source.read())]]
        fake.gpu(1, errors={})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and read()[1]["sm_active"] is None:
            time.sleep(0.2)
        said.append([read(), ""])
        print(json.dumps(said))
    """
    found, stderr = run(fake_nvml, setup, body)
    (first, doctor), (later, _) = found
    assert [gpu["up"] for gpu in first] == [True, True], stderr
    assert first[1]["power"] is not None and first[1]["sm_active"] is None
    reason = "GPM refused (no permission)" if code == NO_PERMISSION else "GPM failed"
    assert reason in doctor, doctor
    assert [gpu["up"] for gpu in later] == [True, True] and later[1]["sm_active"] is not None, later


@pytest.mark.parametrize(
    ("function", "listed"),
    [
        ("nvmlDeviceGetMemoryInfo", [[1, "3g.40gb", False, [999001]], [2, "1g.10gb", False, []]]),
        ("nvmlGpuInstanceGetInfo", [[1, "", True, [999001]], [2, "", True, []]]),
        ("nvmlDeviceGetComputeInstanceId", []),
        ("nvmlDeviceGetMigDeviceHandleByIndex", []),
    ],
)
def test_a_mig_device_nvml_will_not_describe_leaves_its_gpu_up(
    fake_nvml: FakeNvml, function: str, listed: list
) -> None:
    """A MIG device call NVML refuses (no permission) leaves the value absent where the device can
    still be named, the device out where it cannot (and `doctor` says so); its GPU stays up."""
    setup = f"""
        fake.processes(
            1, [{{"pid": 999001, "used_memory": 2**30, "gpu_instance": 1, "compute_instance": 0}}]
        )
        fake.mig(1, [
            {{"gpu_instance": 1, "compute_instance": 0, "profile": "3g.40gb"}},
            {{"gpu_instance": 2, "compute_instance": 0, "profile": "1g.10gb"}},
        ])
        fake.gpu(1, errors={{"{function}": {NO_PERMISSION}}})
    """
    body = "print(json.dumps([read(), source.describe(source.read())]))"
    found, stderr = run(fake_nvml, setup, body)
    gpus, doctor = found
    assert [gpu["up"] for gpu in gpus] == [True, True], stderr
    assert gpus[1]["power"] is not None
    assert gpus[1]["mig"] == listed
    assert ("GPU 1 cannot report mig_devices" in doctor) == (not listed), doctor


def test_a_gpu_down_at_the_start_has_its_xids_counted_once_back(fake_nvml: FakeNvml) -> None:
    """XID events are registered as each GPU is acquired: one lost when the source started is
    counted from the sample it comes back, and the others all along."""
    body = """
        ups = [[gpu["up"] for gpu in read()]]
        fake.gpu(1, lost=False)
        time.sleep(0.5)  # past the backoff of a GPU that failed: acquired again at the next read
        ups.append([gpu["up"] for gpu in read()])
        fake.add_xid(0, 79)
        fake.add_xid(1, 48)
        fake.add_xid(1, 48)
        print(json.dumps([ups, [gpu["xids"] for gpu in read()]]))
    """
    found, stderr = run(fake_nvml, "fake.gpu(1, lost=True)", body)
    ups, xids = found
    assert ups == [[True, False], [True, True]], stderr
    assert xids == [[[79, 1]], [[48, 2]]], stderr


def test_nvml_not_available_in_a_slow_counter_is_no_count(fake_nvml: FakeNvml) -> None:
    """NVML's N/A (all ones) in PCIe replays, remapped rows and clock-event time is left out, not
    published as billions of replays or centuries of throttling."""
    setup = f"""
        fake.gpu(
            1,
            violation_power={NOT_AVAILABLE_ULONGLONG},
            violation_thermal=5_000_000_000,
            pcie_replay_counter={NOT_AVAILABLE_UINT},
            remapped_rows_correctable={NOT_AVAILABLE_UINT},
            remapped_rows_uncorrectable=2,
        )
    """
    found, stderr = run(fake_nvml, setup, "print(json.dumps(read()))")
    gpu = found[1]
    assert gpu["up"], stderr
    assert gpu["pcie_replays"] is None and gpu["rows"] == [None, 2]
    assert "power" not in gpu["clock_events"] and gpu["clock_events"]["thermal"] == 5.0


def test_two_gpus_down_at_the_start_keep_an_index_each(fake_nvml: FakeNvml) -> None:
    """A GPU down before NVML gave its uuid has none: two such are still two devices, each with
    its own node-wide index, and the GPUs after them keep theirs."""
    setup = """
        fake.set(device_count=4)
        fake.gpu(1, lost=True)
        fake.gpu(2, lost=True)
    """
    body = """
        from kepler_bridge.sampling.device_index import DeviceIndexes
        numbered = DeviceIndexes().number(source.read().gpus, 0.0)
        print(json.dumps([[gpu.index, gpu.up, gpu.uuid[-1:]] for gpu in numbered]))
    """
    found, stderr = run(fake_nvml, setup, body)
    assert found == [[0, True, "0"], [1, False, ""], [2, False, ""], [3, True, "3"]], stderr


def test_a_gpu_down_at_the_start_keeps_its_index_once_back(fake_nvml: FakeNvml) -> None:
    """Down before NVML gave its uuid, GPU 0 is numbered by its place; back with its uuid, it
    keeps that index (gpu="0", and dcgm's device="nvidia0"), not the next unused one."""
    setup = "fake.gpu(0, lost=True)"
    body = """
        from kepler_bridge.sampling.device_index import DeviceIndexes
        indexes = DeviceIndexes()
        first = indexes.number(source.read().gpus, 0.0)
        fake.gpu(0, lost=False)
        time.sleep(0.5)  # past the backoff of a GPU that failed: acquired again at the next read
        again = indexes.number(source.read().gpus, 1.0)
        print(json.dumps([[[gpu.index, gpu.up, gpu.uuid[-1:]] for gpu in found]
                          for found in (first, again)]))
    """
    found, stderr = run(fake_nvml, setup, body)
    assert found == [[[0, False, ""], [1, True, "1"]], [[0, True, "0"], [1, True, "1"]]], stderr
