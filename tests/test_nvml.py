"""The NVML source through the real pynvml binding against the fake libnvidia-ml.so.1, in the
real agent."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pynvml
import pytest
import requests

from agent import KEPLER_BRIDGE, Agent
from fakenvml import FakeNvml
from fixtures.sysfs import FakeSysfs
from kepler_bridge.sources.nvml import gpm
from scaffold import samples, values

GIB = 1024**3
SENTINELS = ("4294967295", "4.294967295e+09", "1.8446744073709552e+19", "-1.0")


pytestmark = pytest.mark.e2e


def nvml_agent(fake: FakeNvml, *args: str, ready: bool = True) -> Agent:
    return Agent(
        "--sources",
        "nvml",
        "--nvml-library",
        str(fake.library),
        "--interval",
        "0.25s",
        *args,
        env=fake.env(),
        ready=ready,
    )


def test_values_arrive_in_contract_units(fake_nvml: FakeNvml) -> None:
    fake_nvml.processes(
        0,
        [
            {"pid": os.getpid(), "used_memory": 2 * GIB, "sm_util": 60, "mem_util": 10},
            {"pid": 999999, "used_memory": GIB, "sm_util": 20, "mem_util": 5},
        ],
    )
    fake_nvml.gpu(
        0,
        clocks_event_reasons=0x40 | 0x4,
        ecc_uncorrected_volatile=3,
        encoder_utilization=12,
        decoder_utilization=7,
    )
    with nvml_agent(fake_nvml) as agent:
        text = agent.metrics()
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.5, "1": 0.5}
        assert agent.samples("gpu_memory_utilization_ratio")["0"] == 0.3
        assert agent.samples("gpu_encoder_utilization_ratio") == {"0": 0.12, "1": 0.0}
        assert agent.samples("gpu_decoder_utilization_ratio") == {"0": 0.07, "1": 0.0}
        assert agent.samples("gpu_memory_total_bytes")["0"] == 80 * GIB
        assert agent.samples("gpu_memory_used_bytes")["0"] == 10 * GIB
        assert agent.samples("gpu_temperature_celsius")["0"] == 60
        assert agent.samples("gpu_memory_temperature_celsius")["0"] == 70
        assert agent.samples("gpu_power_watts")["0"] == 250
        assert agent.samples("gpu_power_limit_watts")["0"] == 400
        assert agent.samples("gpu_energy_joules_total")["0"] == pytest.approx(1_000_000)
        assert agent.samples("gpu_sm_clock_hertz")["0"] == 1410e6
        assert agent.samples("gpu_memory_clock_hertz")["0"] == 1593e6
        assert agent.samples("gpu_fan_speed_ratio")["0"] == 0.4
        assert agent.samples("gpu_pcie_transmit_bytes_per_second")["0"] == 1000 * 1024
        assert agent.samples("gpu_pcie_receive_bytes_per_second")["0"] == 2000 * 1024
        assert agent.samples("gpu_performance_state")["0"] == 0
        assert (
            'gpu_throttled{gpu="0",model="NVIDIA Fake A100",node="test-node",'
            'reason="hw_thermal_slowdown"' in text
        )
        assert (
            'kind="uncorrected",model="NVIDIA Fake A100",node="test-node",'
            'uuid="GPU-fa4e0000-0000-4000-8000-000000000000",vendor="nvidia"} 3.0' in text
        )
        assert 'driver_version="' in text and 'pci_bus_id="00000000:10:00.0"' in text
        comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
        assert f'pid="{os.getpid()}"' in text and f'comm="{comm}"' in text
        util = agent.wait_for(
            lambda: _process_values(agent.metrics(), "gpu_process_utilization_ratio"),
            what="process utilization",
        )
        assert util == {str(os.getpid()): 0.6, "999999": 0.2}
        assert _process_values(text, "gpu_process_memory_used_bytes") == {
            str(os.getpid()): 2 * GIB,
            "999999": GIB,
        }


def _process_values(text: str, name: str) -> dict[str, float]:
    return {s.labels["pid"]: s.value for s in samples(text, name) if s.labels["gpu"] == "0"}


def test_a_gpu_process_row_follows_each_change_of_its_values(fake_nvml: FakeNvml) -> None:
    """The source keeps a process's row while NVML gives the same values: a changed memory or
    utilization still reaches /metrics at the next sample, and an exited process goes."""
    me, other = {"pid": os.getpid(), "used_memory": GIB, "sm_util": 60}, {"pid": 999999}
    fake_nvml.processes(0, [me, {**other, "used_memory": GIB, "sm_util": 20}])
    with nvml_agent(fake_nvml) as agent:

        def seen(name: str, want: dict[str, float]) -> None:
            agent.wait_for(lambda: _process_values(agent.metrics(), name) == want, what=name)

        seen("gpu_process_utilization_ratio", {str(os.getpid()): 0.6, "999999": 0.2})
        time.sleep(0.6)  # samples with the same values
        fake_nvml.processes(0, [{**me, "used_memory": 3 * GIB}, {**other, "used_memory": GIB}])
        seen("gpu_process_memory_used_bytes", {str(os.getpid()): 3 * GIB, "999999": GIB})
        seen("gpu_process_utilization_ratio", {str(os.getpid()): 0.6, "999999": 0.0})
        fake_nvml.processes(0, [{**me, "used_memory": 3 * GIB, "sm_util": 70}])
        seen("gpu_process_utilization_ratio", {str(os.getpid()): 0.7})
        seen("gpu_process_memory_used_bytes", {str(os.getpid()): 3 * GIB})


def test_a_process_listed_in_several_utilization_samples_gets_its_latest_valid_one(
    fake_nvml: FakeNvml,
) -> None:
    """NVML may give a pid more than one utilization sample: the latest by time stamp counts (of
    two with the same stamp, the one listed later), and a sample beyond 100 % counts for nothing."""
    later = int(time.time() * 1e6) + 3_600_000_000  # after any time the source asks from
    fake_nvml.processes(
        0,
        [
            {"pid": 999001, "used_memory": GIB, "sm_util": 70, "timestamp": later + 2},
            {"pid": 999001, "used_memory": GIB, "sm_util": 30, "timestamp": later + 1},
            {"pid": 999001, "used_memory": GIB, "sm_util": 150, "timestamp": later + 3},
            {"pid": 999002, "used_memory": GIB, "sm_util": 10, "timestamp": later},
            {"pid": 999002, "used_memory": GIB, "sm_util": 40, "timestamp": later},
            {"pid": 999003, "used_memory": GIB, "sm_util": 101, "timestamp": later},
        ],
    )
    script = textwrap.dedent(
        """
        import json, sys
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        rows = source.read().gpus[0].processes
        source.stop()
        print(json.dumps({row.pid: row.utilization for row in rows}))
        """
    )
    found, stderr = fake_nvml.printed(script)
    assert found == {"999001": 0.7, "999002": 0.4, "999003": 0.0}, stderr


def test_a_utilization_sample_published_late_is_still_read(fake_nvml: FakeNvml) -> None:
    """nvmlDeviceGetProcessUtilization returns the samples newer than the timestamp given, which
    NVML's documentation says to take from the last query's samples: a sample stamped before the
    agent's last call but published after it (or an NTP step) is read, not lost as 0 %."""
    script = textwrap.dedent(
        """
        import json, sys, time
        from pathlib import Path
        sys.path.insert(0, sys.argv[3])
        from fakenvml import FakeNvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[2]), gpus=1)
        now_us = lambda: int(time.time() * 1e6)
        fake.processes(0, [{"pid": 1, "sm_util": 10, "timestamp": now_us() - 2_000_000}])
        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        first = source.read().gpus[0].processes[0].utilization
        late = now_us() - 100_000  # before the read above, published after it
        fake.processes(0, [{"pid": 1, "sm_util": 80, "timestamp": late}])
        time.sleep(0.3)
        second = source.read().gpus[0].processes[0].utilization
        source.stop()
        print(json.dumps([first, second]))
        """
    )
    tests = str(Path(__file__).resolve().parent)
    found, stderr = fake_nvml.printed(script, str(fake_nvml.config), tests)
    assert found == [0.1, 0.8], stderr


def test_memory_falls_back_to_v1(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(1, memory_v2=False)
    with nvml_agent(fake_nvml) as agent:
        totals = agent.samples("gpu_memory_total_bytes")
        assert totals == {"0": 80 * GIB, "1": 80 * GIB}
        assert set(agent.samples("gpu_memory_used_bytes")) == {"0", "1"}
    calls = fake_nvml.calls()
    assert (
        calls.get("nvmlDeviceGetMemoryInfo", 0) >= 1
        and calls.get("nvmlDeviceGetMemoryInfo_v2", 0) >= 2
    )


def test_not_supported_is_remembered_and_not_asked_again(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(0, not_supported=["nvmlDeviceGetFanSpeed", "nvmlDeviceGetPowerUsage"])
    with nvml_agent(fake_nvml) as agent:
        agent.wait_for(
            lambda: fake_nvml.calls().get("nvmlDeviceGetFanSpeed", 0) >= 12, what="12 fan reads"
        )
        assert agent.samples("gpu_fan_speed_ratio") == {"1": 0.4}
        assert set(agent.samples("gpu_power_watts")) == {"1"}
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
    calls = fake_nvml.calls()
    # GPU 1 is asked once per sample; GPU 0 only once, ever.
    assert calls["nvmlDeviceGetFanSpeed"] == calls["nvmlDeviceGetPowerUsage"]
    assert calls["nvmlDeviceGetUtilizationRates"] - calls["nvmlDeviceGetFanSpeed"] in range(
        calls["nvmlDeviceGetFanSpeed"] - 3, calls["nvmlDeviceGetFanSpeed"] + 3
    )


def test_garbage_readings_are_dropped(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(
        1,
        utilization_gpu=250,
        temperature=4294967295,
        power_usage=4294967295,
        clock_sm=4294967295,
        fan_speed=255,
        memory_used=2**64 - 1,
        performance_state=32,
        pcie_tx=4294967295,
        memory_temperature=200,
    )
    with nvml_agent(fake_nvml) as agent:
        text = agent.metrics()
        for name in (
            "gpu_utilization_ratio",
            "gpu_temperature_celsius",
            "gpu_power_watts",
            "gpu_sm_clock_hertz",
            "gpu_fan_speed_ratio",
            "gpu_memory_used_bytes",
            "gpu_performance_state",
            "gpu_pcie_transmit_bytes_per_second",
            "gpu_memory_temperature_celsius",
        ):
            assert set(agent.samples(name)) == {"0"}, name
        for sentinel in SENTINELS:
            assert f" {sentinel}\n" not in text
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}


def test_a_fan_above_its_rated_maximum_is_shown(fake_nvml: FakeNvml) -> None:
    """nvmlDeviceGetFanSpeed: a percent of the fan's noise-tolerance maximum that "may exceed
    100%", as when the fan runs hardest."""
    fake_nvml.gpu(1, fan_speed=105)
    with nvml_agent(fake_nvml) as agent:
        assert agent.samples("gpu_fan_speed_ratio")["1"] == 1.05


def test_lost_gpu_alone_goes_down_and_comes_back_with_monotonic_counters(
    fake_nvml: FakeNvml,
) -> None:
    with nvml_agent(fake_nvml) as agent:
        before = agent.samples("gpu_energy_joules_total")["1"]
        fake_nvml.gpu(1, lost=True)
        agent.wait_for(lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 0.0}, what="GPU 1 down")
        assert set(agent.samples("gpu_utilization_ratio")) == {"0"}
        assert agent.samples("kepler_bridge_source_up") == {"": 1.0}
        body = agent.get("/v1/collect").json()["test-node"]
        assert body["deviceNum"] == 2 and body["devices"][1] == {
            "usedMemory": 0,
            "totalMemory": 0,
            "percent": 0,
        }
        assert body["devices"][0]["totalMemory"] == 80 * GIB
        # The GPU comes back after a reset: its energy counter restarted from a lower value.
        fake_nvml.gpu(1, lost=False, total_energy=5_000)
        agent.wait_for(
            lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}, timeout=15, what="GPU 1 back"
        )
        assert set(agent.samples("gpu_utilization_ratio")) == {"0", "1"}
        assert agent.samples("gpu_energy_joules_total")["1"] >= before


def test_driver_failing_every_call_keeps_the_agent_serving(fake_nvml: FakeNvml) -> None:
    with nvml_agent(fake_nvml) as agent:
        fake_nvml.set(fail_all=999)
        agent.wait_for(
            lambda: agent.samples("kepler_bridge_source_up") == {"": 0.0}, what="nvml down"
        )
        assert agent.samples("gpu_up") == {"0": 0.0, "1": 0.0}
        assert agent.samples("kepler_bridge_source_errors_total")[""] >= 1
        collect = agent.get("/v1/collect")
        assert collect.status_code == 200 and collect.json()["test-node"]["deviceNum"] == 2
        assert agent.get("/metrics").status_code == 200
        ready = agent.get("/readyz")
        assert ready.status_code == 503 and "nvml" in ready.json()["reason"]
        fake_nvml.set(fail_all=0)
        agent.wait_for(
            lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}, timeout=15, what="recovery"
        )
        assert agent.samples("kepler_bridge_source_up") == {"": 1.0}


def test_init_failure_leaves_source_down_with_reason_then_recovers(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.nvidia_pci(
        "0000:17:00.0"
    )  # NVIDIA GPUs are there, so a driver that does not load is a failure
    fake_nvml.set(init_error=9)
    with nvml_agent(fake_nvml, "--sysfs", str(sysfs.root), ready=False) as agent:
        # /healthz answers as soon as the worker serves; the first sample may still be running.
        agent.wait_for(lambda: agent.get("/metrics").ok, timeout=30, what="the first sample")
        assert agent.samples("kepler_bridge_source_up") == {"": 0.0}
        ready = agent.get("/readyz")
        assert ready.status_code == 503 and "driver is not loaded" in ready.json()["reason"]
        assert agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 0
        fake_nvml.set(init_error=0)
        agent.wait_for(
            lambda: agent.get("/readyz").status_code == 200, timeout=15, what="NVML retried"
        )
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}


def test_slow_driver_does_not_slow_scrapes(fake_nvml: FakeNvml) -> None:
    with nvml_agent(fake_nvml) as agent:
        fake_nvml.set(delay_ms=3000)
        time.sleep(1.0)  # the sampler is now inside a 3 s driver call
        session = requests.Session()
        for path in ("/metrics", "/v1/collect") * 15:
            # A scrape that waited for the driver would outlast this client timeout.
            assert session.get(agent.url + path, timeout=1.5).status_code == 200
        # The answers came from the last snapshot: the sampler is still inside slow driver calls.
        assert time.time() - agent.samples("kepler_bridge_last_sample_timestamp_seconds")[""] > 1.0
        assert agent.stop() < 2.0


def test_xid_events_are_counted(fake_nvml: FakeNvml) -> None:
    with nvml_agent(fake_nvml) as agent:
        fake_nvml.add_xid(1, 79)
        fake_nvml.add_xid(1, 79)
        fake_nvml.add_xid(0, 48)

        def counted() -> str:
            text = agent.metrics()
            return text if _xid(text, "1", "79") == 2 and _xid(text, "0", "48") == 1 else ""

        text = agent.wait_for(counted, what="XIDs 79, 79 on GPU 1 and 48 on GPU 0")
        assert text.count('xid="79"') == 1 and _xid(text, "0", "79") == 0
        assert time.time() - agent.samples("gpu_last_xid_timestamp_seconds")["1"] < 10
        assert "0" in agent.samples("gpu_last_xid_timestamp_seconds")


def test_an_event_wait_that_fails_leaves_the_xids_for_a_later_sample(fake_nvml: FakeNvml) -> None:
    """nvmlEventSetWait failing with an error other than its timeout ends that sample's drain
    without a count or a GPU down; the events pending are counted once the wait works again."""
    with nvml_agent(fake_nvml) as agent:
        fake_nvml.set(errors={"nvmlEventSetWait_v2": pynvml.NVML_ERROR_UNKNOWN})
        fake_nvml.add_xid(1, 79)
        fake_nvml.add_xid(0, 48)
        started = agent.samples("kepler_bridge_last_sample_timestamp_seconds")[""]
        agent.wait_for(
            lambda: agent.samples("kepler_bridge_last_sample_timestamp_seconds")[""] > started + 2,
            what="samples two seconds on",
        )
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        assert _xids(agent.metrics(), "1") == {} and _xids(agent.metrics(), "0") == {}
        fake_nvml.set(errors={})
        agent.wait_for(
            lambda: (
                _xids(agent.metrics(), "1") == {"79": 1.0}
                and _xids(agent.metrics(), "0") == {"48": 1.0}
            ),
            what="XID 79 on GPU 1 and 48 on GPU 0 once the wait works",
        )


def test_xid_codes_beyond_the_64_most_recent_are_summed_as_other(fake_nvml: FakeNvml) -> None:
    def counts(total: int) -> dict[str, float]:
        found = _xids(agent.metrics(), "0")
        return found if sum(found.values()) == total else {}

    with nvml_agent(fake_nvml) as agent:
        fake_nvml.add_xid(0, 1)
        fake_nvml.add_xid(0, 1)
        assert agent.wait_for(lambda: counts(2), what="2 XIDs on GPU 0") == {"1": 2.0}
        for code in range(2, 71):
            fake_nvml.add_xid(0, code)
        before = agent.wait_for(lambda: counts(71), what="71 XIDs on GPU 0")
        assert before == {**{str(code): 1.0 for code in range(7, 71)}, "other": 7.0}
        fake_nvml.add_xid(
            0, 1
        )  # recent again: a series of its own anew, while "other" never decreases
        after = agent.wait_for(lambda: counts(72), what="72 XIDs on GPU 0")
        assert after == {**{str(code): 1.0 for code in range(8, 71)}, "1": 1.0, "other": 8.0}
        assert _xids(agent.metrics(), "1") == {}


def test_the_last_xid_code_is_the_one_that_came_last(fake_nvml: FakeNvml) -> None:
    def last(expected: dict[str, float]) -> dict[str, float]:
        found = {
            sample.labels["gpu"]: sample.value
            for sample in samples(agent.metrics(), "DCGM_FI_DEV_XID_ERRORS")
        }
        return found if found == expected else {}

    with nvml_agent(fake_nvml, "--metric-names", "dcgm") as agent:
        for gpu, code in [(0, 79), (0, 79), (1, 13), (0, 48)]:
            fake_nvml.add_xid(gpu, code)
        agent.wait_for(lambda: last({"0": 48.0, "1": 13.0}), what="XIDs 79, 79, 48 and 13")
        for code in range(100, 170):  # more codes than are counted each: the last is still known
            fake_nvml.add_xid(0, code)
        agent.wait_for(lambda: last({"0": 169.0, "1": 13.0}), what="XID 169 last on GPU 0")


def _xids(text: str, gpu: str) -> dict[str, float]:
    return {
        sample.labels["xid"]: sample.value
        for sample in samples(text, "gpu_xid_errors_total")
        if sample.labels["gpu"] == gpu
    }


def _xid(text: str, gpu: str, xid: str) -> float:
    return _xids(text, gpu).get(xid, 0.0)


def test_nvml_is_initialised_in_the_worker_not_the_master(fake_nvml: FakeNvml) -> None:
    with nvml_agent(fake_nvml) as agent:
        master = agent.process.pid
        workers = Path(f"/proc/{master}/task/{master}/children").read_text().split()
        assert len(workers) == 1
        assert str(fake_nvml.library) not in Path(f"/proc/{master}/maps").read_text()
        assert str(fake_nvml.library) in Path(f"/proc/{workers[0]}/maps").read_text()


def test_collect_and_doctor_commands(fake_nvml: FakeNvml) -> None:
    env = {**os.environ, **fake_nvml.env(), "KUBE_NODE_NAME": "edge-1"}
    args = ["--sources", "nvml", "--nvml-library", str(fake_nvml.library)]
    collect = subprocess.run(
        [KEPLER_BRIDGE, "collect", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert collect.returncode == 0, collect.stderr

    node = json.loads(collect.stdout)["edge-1"]
    assert node["deviceNum"] == 2 and node["devices"][0]["totalMemory"] == 80 * GIB
    prom = subprocess.run(
        [KEPLER_BRIDGE, "collect", "--prometheus", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert 'gpu_up{gpu="1"' in prom.stdout
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--nvml-library", str(fake_nvml.library)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert doctor.returncode == 0
    assert any(
        line.startswith("ok") and "nvml" in line and "2 GPU(s)" in line
        for line in doctor.stdout.splitlines()
    ), doctor.stdout
    missing = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--sources", "nvml", "--nvml-library", "/nope/libnvidia-ml.so.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert any(
        line.startswith("no") and "nvml" in line and "does not exist" in line
        for line in missing.stdout.splitlines()
    ), missing.stdout
    assert missing.returncode == 1, "procfs works, but --sources leaves it out"


def _gpm_rates(fake: FakeNvml, index: int, not_supported: tuple[int, ...] = ()) -> None:
    """GPU `index` with GPM, busy at known rates (% and MiB/s), with two NVDECs of eight."""
    fake.gpu(
        index,
        gpm_supported=True,
        gpm_metrics={
            pynvml.NVML_GPM_METRIC_SM_UTIL: 80.0,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 25.0,
            pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 95.0,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 60.0,
            pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: 55.0,
            pynvml.NVML_GPM_METRIC_FP32_UTIL: 10.0,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 40.0,
            pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
            pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 2048.0,
            pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL: 20.0,
            pynvml.NVML_GPM_METRIC_NVDEC_1_UTIL: 40.0,
        },
        gpm_not_supported=[*range(32, 38), *not_supported],  # NVDEC 2..7: this GPU has two
    )


def _gpm(agent: Agent, name: str, label: str = "") -> dict[str, float]:
    return {
        s.labels["gpu"] + (f"/{s.labels[label]}" if label else ""): s.value
        for s in samples(agent.metrics(), name)
    }


def test_gpm_profiling_metrics_in_contract_units(fake_nvml: FakeNvml) -> None:
    _gpm_rates(fake_nvml, 0, not_supported=(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,))
    with nvml_agent(fake_nvml) as agent:
        agent.wait_for(lambda: _gpm(agent, "gpu_sm_active_ratio"), what="GPM metrics")
        approx = pytest.approx
        assert _gpm(agent, "gpu_sm_active_ratio") == {"0": approx(0.8)}
        assert _gpm(agent, "gpu_sm_occupancy_ratio") == {"0": approx(0.25)}
        assert _gpm(agent, "gpu_graphics_active_ratio") == {"0": approx(0.95)}
        assert _gpm(agent, "gpu_tensor_active_ratio") == {"0": approx(0.6)}
        pipes = _gpm(agent, "gpu_pipe_active_ratio", "pipe")
        assert pipes == {
            "0/tensor_hmma": approx(0.55),
            "0/tensor_imma": 0.0,
            "0/tensor_dfma": 0.0,
            "0/fp64": 0.0,
            "0/fp32": approx(0.1),
            "0/fp16": 0.0,
            "0/integer": 0.0,
        }
        engines = _gpm(agent, "gpu_engine_active_ratio", "engine")
        assert engines == {"0/nvdec": approx(0.3), "0/nvjpg": 0.0, "0/nvofa": 0.0}
        pcie = _gpm(agent, "gpu_profiled_pcie_transmit_bytes_per_second")
        assert pcie == {"0": approx(100 * 1024**2)}
        nvlink = _gpm(agent, "gpu_profiled_nvlink_receive_bytes_per_second")
        assert nvlink == {"0": approx(2 * GIB)}
        # A metric GPM does not report is absent, not zero; so is every family on GPU 1.
        assert _gpm(agent, "gpu_dram_active_ratio") == {}
        assert _gpm(agent, "gpu_profiled_nvlink_transmit_bytes_per_second") == {"0": 0.0}
        assert agent.samples("gpu_utilization_ratio") == {"0": 0.5, "1": 0.5}
    calls = fake_nvml.calls()
    assert calls["nvmlGpmQueryDeviceSupport"] == 2
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] == 2  # GPU 0's, freed on stop
    assert calls["nvmlGpmMetricsGet"] == calls["nvmlGpmSampleGet"] - 1


def test_gpm_samples_follow_the_gpu_through_loss_and_failures(fake_nvml: FakeNvml) -> None:
    _gpm_rates(fake_nvml, 0)
    _gpm_rates(fake_nvml, 1)
    with nvml_agent(fake_nvml) as agent:
        both = {"0": pytest.approx(0.8), "1": pytest.approx(0.8)}
        agent.wait_for(lambda: _gpm(agent, "gpu_sm_active_ratio") == both, what="GPM on both")
        fake_nvml.gpu(1, lost=True)
        agent.wait_for(lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 0.0}, what="GPU 1 down")
        assert set(_gpm(agent, "gpu_sm_active_ratio")) == {"0"}
        fake_nvml.gpu(1, lost=False)
        agent.wait_for(
            lambda: _gpm(agent, "gpu_sm_active_ratio") == both, timeout=15, what="GPM on GPU 1 back"
        )
        # Samples failing: GPU 0 stays up without profiling metrics, and they come back.
        fake_nvml.gpu(0, errors={"nvmlGpmSampleGet": 999})
        agent.wait_for(lambda: set(_gpm(agent, "gpu_sm_active_ratio")) == {"1"}, what="no GPM")
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        fake_nvml.gpu(0, errors={})
        agent.wait_for(lambda: _gpm(agent, "gpu_sm_active_ratio") == both, what="GPM again")
    calls = fake_nvml.calls()
    # Two per GPU at the start, two more for GPU 1 once back; every one freed.
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] == 6


def test_doctor_says_why_a_gpu_has_no_profiling_metrics(fake_nvml: FakeNvml) -> None:
    _gpm_rates(fake_nvml, 0)
    fake_nvml.gpu(1, not_supported=["fan_speed", "memory_temperature", "pcie_throughput"])
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--sources", "nvml", "--nvml-library", str(fake_nvml.library)],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = [line for line in doctor.stdout.splitlines() if "nvml" in line]
    assert line.startswith("ok") and "GPM profiling on GPU 0" in line, doctor.stdout
    assert "GPU 1: GPM not supported (needs Hopper or newer)" in line, line
    # The fake's GPUs have no NVLink unless configured; GPU 1 also lacks two sensors and PCIe
    # throughput (measured apart from the samples, named all the same).
    assert "GPU 0 cannot report nvlink (not supported: absent)" in line, line
    lacks = "fan, memory_temperature, nvlink, pcie_rx, pcie_tx"
    assert f"GPU 1 cannot report {lacks} (not supported" in line, line
    calls = fake_nvml.calls()
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] == 2


def test_gpm_values_out_of_range_are_dropped() -> None:
    found = gpm.fields(
        {
            pynvml.NVML_GPM_METRIC_SM_UTIL: 250.0,
            pynvml.NVML_GPM_METRIC_FP64_UTIL: -1.0,
            pynvml.NVML_GPM_METRIC_FP16_UTIL: 50.0,
            pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 1e12,
            pynvml.NVML_GPM_METRIC_NVOFA_0_UTIL: 10.0,
        }
    )
    assert found["sm_active"] is None and found["profiled_pcie_receive_bytes_per_second"] is None
    assert found["pipe_active"] == (("fp16", 0.5),)
    assert found["engine_active"] == (("nvofa", 0.1),)


def _by_labels(text: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """Values of one metric of GPU 0, keyed by the given labels."""
    return {
        tuple(s.labels[label] for label in labels): s.value
        for s in samples(text, name)
        if s.labels["gpu"] == "0"
    }


def test_reliability_and_links_arrive_in_contract_units(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(
        0,
        nvlink_count=2,
        nvlink_tx_kib=[1, 2],
        nvlink_rx_kib=[3, 4],
        nvlink_crc_flit=[5, 0],
        nvlink_crc_data=[0, 6],
        nvlink_replay=[7, 0],
        nvlink_recovery=[0, 8],
        remapped_rows_correctable=2,
        remapped_rows_uncorrectable=1,
        remapped_rows_pending=1,
        retired_pages_single_bit=3,
        retired_pages_double_bit=1,
        pcie_replay_counter=9,
        violation_power=2_500_000_000,
        violation_reliability=1_000,
    )
    with nvml_agent(fake_nvml) as agent:
        text = agent.metrics()
        assert _by_labels(text, "gpu_nvlink_up", "link") == {("0",): 1.0, ("1",): 1.0}
        assert _by_labels(text, "gpu_nvlink_transmit_bytes_total", "link") == {
            ("0",): 1024.0,
            ("1",): 2048.0,
        }
        assert _by_labels(text, "gpu_nvlink_receive_bytes_total", "link") == {
            ("0",): 3072.0,
            ("1",): 4096.0,
        }
        assert _by_labels(text, "gpu_nvlink_errors_total", "link", "kind") == {
            ("0", "crc_flit"): 5.0,
            ("0", "crc_data"): 0.0,
            ("0", "replay"): 7.0,
            ("0", "recovery"): 0.0,
            ("1", "crc_flit"): 0.0,
            ("1", "crc_data"): 6.0,
            ("1", "replay"): 0.0,
            ("1", "recovery"): 8.0,
        }
        assert _by_labels(text, "gpu_remapped_rows_total", "cause") == {
            ("correctable",): 2.0,
            ("uncorrectable",): 1.0,
        }
        assert agent.samples("gpu_row_remap_pending") == {"0": 1.0, "1": 0.0}
        assert agent.samples("gpu_row_remap_failed") == {"0": 0.0, "1": 0.0}
        assert _by_labels(text, "gpu_retired_pages_total", "cause") == {
            ("single_bit",): 3.0,
            ("double_bit",): 1.0,
        }
        assert agent.samples("gpu_retired_pages_pending") == {"0": 0.0, "1": 0.0}
        assert agent.samples("gpu_pcie_replays_total") == {"0": 9.0, "1": 0.0}
        assert agent.samples("gpu_memory_reserved_bytes") == {"0": 512 * 2**20, "1": 512 * 2**20}
        assert _by_labels(text, "gpu_clock_event_seconds_total", "reason") == {
            ("power",): 2.5,
            ("thermal",): 0.0,
            ("sync_boost",): 0.0,
            ("board_limit",): 0.0,
            ("low_utilization",): 0.0,
            ("reliability",): 1e-6,
        }
        # GPU 1 has no NVLink: no link series at all, never zeros
        assert {s.labels["gpu"] for s in samples(text, "gpu_nvlink_up")} == {"0"}


def test_reliability_not_supported_is_absent_and_not_asked_again(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(
        0,
        nvlink_count=2,
        not_supported=[
            "remapped_rows",
            "retired_pages",
            "pcie_replay_counter",
            "violation_thermal",
            "nvlink_errors",
        ],
    )
    fake_nvml.gpu(1, memory_v2=False)
    # the slow counters read every sample, so six samples ask GPU 1 six times
    with nvml_agent(fake_nvml, "--nvml-counter-interval", "0") as agent:
        agent.wait_for(
            lambda: fake_nvml.calls().get("nvmlDeviceGetPcieReplayCounter", 0) >= 6,
            what="6 PCIe replay reads",
        )
        text = agent.metrics()
        for name in (
            "gpu_remapped_rows_total",
            "gpu_row_remap_pending",
            "gpu_row_remap_failed",
            "gpu_retired_pages_total",
            "gpu_retired_pages_pending",
            "gpu_pcie_replays_total",
        ):
            assert {s.labels["gpu"] for s in samples(text, name)} == {"1"}, name
        assert set(_by_labels(text, "gpu_clock_event_seconds_total", "reason")) == {
            ("power",),
            ("sync_boost",),
            ("board_limit",),
            ("low_utilization",),
            ("reliability",),
        }
        assert _by_labels(text, "gpu_nvlink_up", "link") == {("0",): 1.0, ("1",): 1.0}
        assert not samples(text, "gpu_nvlink_errors_total")
        # memory through the v1 call has no reserved part
        assert agent.samples("gpu_memory_reserved_bytes") == {"0": 512 * 2**20}
    calls = fake_nvml.calls()
    # GPU 1 is asked once per sample; GPU 0 only once, ever.
    assert (
        calls["nvmlDeviceGetRemappedRows"]
        == calls["nvmlDeviceGetPcieReplayCounter"]
        == calls["nvmlDeviceGetRetiredPagesPendingStatus"]
    )
    # 4 counters of 2 links asked once; GPU 1, without NVLink, never
    assert calls["nvmlDeviceGetNvLinkErrorCounter"] == 8


def test_an_nvlink_going_down_keeps_its_counters_monotonic(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(0, nvlink_count=2, nvlink_tx_kib=[10, 10], nvlink_replay=[4, 4])
    with nvml_agent(fake_nvml, "--nvml-counter-interval", "0") as agent:
        agent.wait_for(
            lambda: _by_labels(agent.metrics(), "gpu_nvlink_up", "link") == {("0",): 1, ("1",): 1},
            what="both links up",
        )
        fake_nvml.gpu(0, nvlink_down=[1])
        down = agent.wait_for(
            lambda: (
                (text := agent.metrics())
                and _by_labels(text, "gpu_nvlink_up", "link") == {("0",): 1.0, ("1",): 0.0}
                and text
            ),
            what="link 1 down",
        )
        assert set(_by_labels(down, "gpu_nvlink_transmit_bytes_total", "link")) == {("0",)}
        assert {k[0] for k in _by_labels(down, "gpu_nvlink_errors_total", "link", "kind")} == {"0"}
        # the link comes back after a reset: its raw counters restarted lower
        fake_nvml.gpu(0, nvlink_down=[], nvlink_tx_kib=[12, 1], nvlink_replay=[5, 1])
        back = agent.wait_for(
            lambda: (
                (text := agent.metrics())
                and ("1",) in _by_labels(text, "gpu_nvlink_transmit_bytes_total", "link")
                and text
            ),
            what="link 1 back",
        )
        assert _by_labels(back, "gpu_nvlink_transmit_bytes_total", "link") == {
            ("0",): 12 * 1024.0,
            ("1",): 11 * 1024.0,
        }
        assert _by_labels(back, "gpu_nvlink_errors_total", "link", "kind")[("1", "replay")] == 5
        # a GPU whose uncorrectable remapped rows rise, then reset to zero, never counts down
        fake_nvml.gpu(0, remapped_rows_uncorrectable=3)
        agent.wait_for(
            lambda: (
                _by_labels(agent.metrics(), "gpu_remapped_rows_total", "cause")[("uncorrectable",)]
                == 3
            ),
            what="3 uncorrectable rows",
        )
        fake_nvml.gpu(0, remapped_rows_uncorrectable=1, remapped_rows_failure=1)
        agent.wait_for(lambda: agent.samples("gpu_row_remap_failed")["0"] == 1, what="failure")
        rows = _by_labels(agent.metrics(), "gpu_remapped_rows_total", "cause")
        assert rows[("uncorrectable",)] == 4


def test_slow_counters_read_once_per_counter_interval_and_kept_between(
    fake_nvml: FakeNvml,
) -> None:
    """ECC, PCIe replays, clock-event time and NVLink errors are read once per
    --nvml-counter-interval; every scrape between carries the last values, and a link coming up
    is read at once."""
    fake_nvml.gpu(0, nvlink_count=2, nvlink_replay=[4, 4], pcie_replay_counter=9)
    with nvml_agent(fake_nvml, "--nvml-counter-interval", "3s") as agent:
        before = fake_nvml.calls()
        fake_nvml.gpu(0, nvlink_count=2, nvlink_replay=[4, 4], pcie_replay_counter=11)
        seen = []
        deadline = time.monotonic() + 8
        while 11.0 not in seen and time.monotonic() < deadline:
            text = agent.metrics()
            seen.append(_by_labels(text, "gpu_pcie_replays_total")[()])
            assert {s.labels["gpu"] for s in samples(text, "gpu_ecc_errors_total")} == {"0", "1"}
            assert len(_by_labels(text, "gpu_clock_event_seconds_total", "reason")) == 6
            time.sleep(0.1)
        assert seen[0] == 9.0 and seen[-1] == 11.0 and set(seen) == {9.0, 11.0}, seen
        calls = fake_nvml.calls()
        power = calls["nvmlDeviceGetPowerUsage"] - before["nvmlDeviceGetPowerUsage"]
        replays = calls["nvmlDeviceGetPcieReplayCounter"] - before["nvmlDeviceGetPcieReplayCounter"]
        assert 0 < replays * 4 <= power  # 0.25 s samples, 3 s between reads: 12 to 1
        # a link that comes back is read at once, not at the next read of the counters
        fake_nvml.gpu(0, nvlink_down=[1])
        agent.wait_for(
            lambda: _by_labels(agent.metrics(), "gpu_nvlink_up", "link") == {("0",): 1, ("1",): 0},
            what="link 1 down",
        )
        fake_nvml.gpu(0, nvlink_down=[], nvlink_replay=[4, 6])
        back = agent.wait_for(
            lambda: (text := agent.metrics()) and (("1", "replay") in _errors(text)) and text,
            what="link 1 back",
        )
        assert _errors(back)[("1", "replay")] == 6


def test_pcie_throughput_is_read_with_the_slow_counters(fake_nvml: FakeNvml) -> None:
    """NVML's PCIe throughput call measures the link for 20 ms before it answers: it is asked once
    per --nvml-counter-interval, not each sample, and every scrape between carries its values."""
    fake_nvml.set(pcie_throughput_ms=20)
    with nvml_agent(fake_nvml, "--nvml-counter-interval", "3s") as agent:
        before = fake_nvml.calls()
        fake_nvml.gpu(0, pcie_tx=3000)
        seen = []
        deadline = time.monotonic() + 8
        while 3000 * 1024 not in seen and time.monotonic() < deadline:
            seen.append(agent.samples("gpu_pcie_transmit_bytes_per_second")["0"])
            assert agent.samples("gpu_pcie_receive_bytes_per_second") == {
                "0": 2000 * 1024,
                "1": 2000 * 1024,
            }
            time.sleep(0.1)
        assert seen[0] == 1000 * 1024 and seen[-1] == 3000 * 1024, seen
        assert set(seen) == {1000 * 1024, 3000 * 1024}, seen
        calls = fake_nvml.calls()
        power = calls["nvmlDeviceGetPowerUsage"] - before["nvmlDeviceGetPowerUsage"]
        pcie = calls["nvmlDeviceGetPcieThroughput"] - before["nvmlDeviceGetPcieThroughput"]
        assert 0 < pcie * 2 <= power  # two calls a read; 0.25 s samples, 3 s between reads


def test_a_pcie_measurement_never_holds_a_sample(fake_nvml: FakeNvml) -> None:
    """The PCIe throughput of the GPUs due is measured beside the samples: while each PCIe call
    takes NVML 1.5 s, samples go on at their interval, and the new values arrive after."""
    with nvml_agent(fake_nvml, "--nvml-counter-interval", "1s") as agent:
        fake_nvml.set(pcie_throughput_ms=1500)  # the next round takes 6 s: 2 GPUs, 2 calls each
        fake_nvml.gpu(0, pcie_tx=3000)
        made = set()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            made.add(agent.samples("kepler_bridge_last_sample_timestamp_seconds")[""])
            time.sleep(0.1)
        # 0.25 s samples: some 16; a sampler that waited in the calls would make at most 5
        assert len(made) >= 8, made
        fake_nvml.set(pcie_throughput_ms=0)
        agent.wait_for(
            lambda: agent.samples("gpu_pcie_transmit_bytes_per_second")["0"] == 3000 * 1024,
            what="the new PCIe throughput",
        )


def test_a_gpu_back_from_a_failure_shows_its_pcie_throughput_at_once(fake_nvml: FakeNvml) -> None:
    """A GPU's PCIe throughput from before it went down is not shown once it is back: it is
    measured in its first reading back, not at the next read of the slow counters (10 s)."""
    with nvml_agent(fake_nvml) as agent:
        assert agent.samples("gpu_pcie_transmit_bytes_per_second")["1"] == 1000 * 1024
        fake_nvml.gpu(1, lost=True)
        agent.wait_for(lambda: agent.samples("gpu_up")["1"] == 0.0, what="GPU 1 down")
        fake_nvml.gpu(1, lost=False, pcie_tx=5000)
        up = agent.wait_for(
            lambda: (text := agent.metrics()) and values(text, "gpu_up", "gpu")["1"] and text,
            timeout=15,
            what="GPU 1 back",
        )
        assert values(up, "gpu_pcie_transmit_bytes_per_second", "gpu")["1"] == 5000 * 1024


def _errors(text: str) -> dict[tuple[str, ...], float]:
    return _by_labels(text, "gpu_nvlink_errors_total", "link", "kind")


TRANSIENT = ["utilization", "temperature", "power_usage", "fan_speed"]
TRANSIENT_SERIES = (
    "gpu_utilization_ratio",
    "gpu_temperature_celsius",
    "gpu_power_watts",
    "gpu_fan_speed_ratio",
)


def _reporting(agent: Agent) -> dict[str, set[str]]:
    """The GPUs reporting each of TRANSIENT_SERIES."""
    text = agent.metrics()
    return {name: {s.labels["gpu"] for s in samples(text, name)} for name in TRANSIENT_SERIES}


def test_a_transient_not_supported_comes_back_after_the_reprobe_interval(
    fake_nvml: FakeNvml,
) -> None:
    both = dict.fromkeys(TRANSIENT_SERIES, {"0", "1"})
    with nvml_agent(fake_nvml, "--nvml-reprobe-interval", "1s") as agent:
        assert _reporting(agent) == both
        fake_nvml.gpu(0, not_supported=TRANSIENT)
        agent.wait_for(
            lambda: _reporting(agent) == dict.fromkeys(TRANSIENT_SERIES, {"1"}),
            what="GPU 0 not reporting utilization, temperature, power, fan",
        )
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        fake_nvml.gpu(0, not_supported=[])
        agent.wait_for(lambda: _reporting(agent) == both, timeout=8, what="GPU 0's values back")


def test_a_field_that_stays_not_supported_is_asked_again_rarely(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpu(0, not_supported=["fan_speed"])
    fake_nvml.gpu(1, not_supported=["fan_speed"])
    with nvml_agent(fake_nvml, "--interval", "100ms", "--nvml-reprobe-interval", "500ms") as agent:
        agent.wait_for(
            lambda: fake_nvml.calls().get("nvmlDeviceGetUtilizationRates", 0) >= 80,
            timeout=30,
            what="40 samples",
        )
        assert set(agent.samples("gpu_up")) == {"0", "1"}
    calls = fake_nvml.calls()
    samples_taken = calls["nvmlDeviceGetUtilizationRates"] / 2
    # Asked at the first sample, then after 0.5, 1, 2, 4 s (doubling): a handful per GPU,
    # against one per sample for a value that answers.
    assert 2 * 2 <= calls["nvmlDeviceGetFanSpeed"] <= 2 * 6, (calls, samples_taken)


def test_a_gpu_whose_every_call_fails_is_down_and_comes_back(fake_nvml: FakeNvml) -> None:
    with nvml_agent(fake_nvml) as agent:
        fake_nvml.gpu(1, not_supported=["*"])
        agent.wait_for(lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 0.0}, what="GPU 1 down")
        assert set(agent.samples("gpu_memory_total_bytes")) == {"0"}
        assert agent.samples("kepler_bridge_source_up") == {"": 1.0}
        devices = agent.get("/v1/collect").json()["test-node"]["devices"]
        # As a lost GPU: its place kept with zeros; GPU 0's reading as before.
        assert devices[1] == {"usedMemory": 0, "totalMemory": 0, "percent": 0}
        assert devices[0]["totalMemory"] == 80 * GIB
        fake_nvml.gpu(1, not_supported=[])
        back = dict.fromkeys(TRANSIENT_SERIES, {"0", "1"})
        agent.wait_for(lambda: _reporting(agent) == back, timeout=15, what="GPU 1 back")
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        assert agent.get("/v1/collect").json()["test-node"]["devices"][1]["totalMemory"] == (
            80 * GIB
        )


def test_gpm_given_up_on_a_transient_not_supported_comes_back(fake_nvml: FakeNvml) -> None:
    _gpm_rates(fake_nvml, 0)
    with nvml_agent(fake_nvml, "--nvml-reprobe-interval", "1s") as agent:
        agent.wait_for(lambda: set(_gpm(agent, "gpu_sm_active_ratio")) == {"0"}, what="GPM")
        fake_nvml.gpu(0, errors={"nvmlGpmSampleGet": pynvml.NVML_ERROR_NOT_SUPPORTED})
        agent.wait_for(lambda: not _gpm(agent, "gpu_sm_active_ratio"), what="GPM given up")
        fake_nvml.gpu(0, errors={})
        agent.wait_for(
            lambda: _gpm(agent, "gpu_sm_active_ratio") == {"0": pytest.approx(0.8)},
            timeout=8,
            what="GPM back",
        )
    calls = fake_nvml.calls()
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"]


def test_a_reading_holds_every_field_of_a_gpu_reading_and_no_other(fake_nvml: FakeNvml) -> None:
    """The source fills a dict of fields into each reading without __init__: whatever a helper
    adds (MIG, profiling, slow counters, NVLinks) must be a GpuReading field."""
    fake_nvml.gpu(0, nvlink_count=2, nvlink_replay=[4, 4], pcie_replay_counter=9)
    fake_nvml.processes(1, [{"pid": 999001, "used_memory": GIB, "gpu_instance": 1}])
    fake_nvml.mig(1, [{"gpu_instance": 1, "compute_instance": 0, "profile": "1g.10gb"}])
    _gpm_rates(fake_nvml, 0)
    script = textwrap.dedent(
        """
        import dataclasses, json, sys, time
        from kepler_bridge import config
        from kepler_bridge.model import GpuReading
        from kepler_bridge.sources.nvml.source import NvmlSource

        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        names = {field.name for field in dataclasses.fields(GpuReading)}
        found = []
        for _ in range(3):  # the second read has GPM's first interval
            found = [
                [gpu.up, sorted(set(vars(gpu)) ^ names), gpu.sm_active is not None,
                 len(gpu.nvlinks), len(gpu.mig_instances)]
                for gpu in source.read().gpus
            ]
            time.sleep(0.1)
        source.stop()
        print(json.dumps(found))
        """
    )
    found, stderr = fake_nvml.printed(script)
    # GPU 0 with profiling and two NVLinks, GPU 1 with a MIG device: every helper ran
    assert found == [[True, [], True, 2, 0], [True, [], False, 0, 1]], stderr


def test_process_lists_longer_than_their_buffers_are_read_whole(fake_nvml: FakeNvml) -> None:
    """A list call answers "too small" when the GPU has more processes than the buffer kept for
    it holds: the buffer grows and the list is read whole, at once; a shorter list later is read
    into the same buffer without leftovers."""
    script = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        sys.path.insert(0, sys.argv[2])
        from fakenvml import FakeNvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[3]), gpus=2, processes_per_gpu=2)
        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        counts = []
        for count in (3, 100, 5, 300):
            fake.processes(0, [{"pid": 200000 + n, "used_memory": 2**30} for n in range(count)])
            counts.append([len(gpu.processes) for gpu in source.read().gpus])
        source.stop()
        print(json.dumps(counts))
        """
    )
    found, stderr = fake_nvml.printed(script, str(Path(__file__).parent), str(fake_nvml.config))
    assert found == [[3, 2], [100, 2], [5, 2], [300, 2]], stderr


def test_a_getter_the_driver_lacks_is_remembered_as_not_supported(fake_nvml: FakeNvml) -> None:
    """A getter called through its function pointer (Device.numbers) that an older driver does not
    export reads as "cannot report", is remembered, and is not looked up again until its
    re-probe; another error of such a getter raises as query's do."""
    fake_nvml.gpu(0, errors={"power_usage": pynvml.NVML_ERROR_GPU_IS_LOST})
    script = textwrap.dedent(
        """
        import ctypes, json, sys
        import pynvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        source.read()
        gpu1 = source.devices[1]
        absent = (("absent", "nvmlDeviceGetNoSuchValue", ctypes.c_uint, ()),)
        [missing] = gpu1.numbers(absent)
        [again] = gpu1.numbers(absent)
        try:
            gpu1.handle = pynvml.nvmlDeviceGetHandleByIndex(0)  # lost, on every call
            gpu1.numbers((("power", "nvmlDeviceGetPowerUsage", ctypes.c_uint, ()),))
            raised = None
        except pynvml.NVMLError as err:
            raised = err.value
        source.stop()
        print(json.dumps([missing, again, "absent" in gpu1.unsupported,
                          "power" in gpu1.unsupported, "absent" in gpu1.getters, raised]))
        """
    )
    found, stderr = fake_nvml.printed(script)
    assert found == [
        None,
        None,
        True,
        False,
        False,
        pynvml.NVML_ERROR_GPU_IS_LOST,
    ], stderr


def test_a_sample_takes_the_xids_nvml_holds_and_at_most_its_bound(fake_nvml: FakeNvml) -> None:
    """The sampler takes XID events without waiting, each read: no event thread. A driver holding
    more than MAX_EVENTS_PER_SAMPLE gives the rest to the next reads, none lost or counted twice."""
    script = textwrap.dedent(
        """
        import json, sys, threading
        from pathlib import Path
        sys.path.insert(0, sys.argv[2])
        from fakenvml import FakeNvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.events import MAX_EVENTS_PER_SAMPLE
        from kepler_bridge.sources.nvml.source import NvmlSource

        fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[3]), gpus=2, processes_per_gpu=0)
        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        threads = threading.active_count()
        for n in range(MAX_EVENTS_PER_SAMPLE + 44):
            fake.add_xid(n % 2, 13 if n % 2 else 79)
        totals = []
        for _ in range(3):
            gpus = source.read().gpus
            totals.append([sum(count for _, count in gpu.xid_errors) for gpu in gpus])
        source.stop()
        print(json.dumps([MAX_EVENTS_PER_SAMPLE, totals, threads]))
        """
    )
    found, stderr = fake_nvml.printed(script, str(Path(__file__).parent), str(fake_nvml.config))
    bound, totals, threads = found
    half = bound // 2
    assert totals == [[half, half], [half + 22, half + 22], [half + 22, half + 22]], stderr
    assert threads == 1, "the nvml source started a thread"


def test_xids_of_the_other_gpus_go_on_while_one_is_lost_and_its_own_once_back(
    fake_nvml: FakeNvml,
) -> None:
    """NVML answers each wait on an event set that holds a lost GPU GPU_IS_LOST, naming none:
    the source waits on a new set of the GPUs that register, the lost one down, one call a read,
    and registers that one again when it comes back."""
    script = textwrap.dedent(
        """
        import ctypes, json, sys, time
        from pathlib import Path
        sys.path.insert(0, sys.argv[2])
        from fakenvml import FakeNvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[3]), gpus=2, processes_per_gpu=0)
        source = NvmlSource(config.load({"nvml_library": sys.argv[1], "interval": "0.2s"}, {}))
        source.start()
        library = ctypes.CDLL(sys.argv[1])
        library.fakenvml_call_count.restype = ctypes.c_ulonglong
        found = []

        def read(*xids):
            for gpu, code in xids:
                fake.add_xid(gpu, code)
            waits = library.fakenvml_call_count(b"nvmlEventSetWait_v2")
            gpus = source.read().gpus
            waits = library.fakenvml_call_count(b"nvmlEventSetWait_v2") - waits
            found.append([[gpu.up, dict(gpu.xid_errors)] for gpu in gpus] + [waits])

        read((0, 79))
        fake.gpu(1, lost=True)
        read()
        read((0, 48), (1, 13))
        read((0, 31))
        fake.gpu(1, lost=False)
        time.sleep(0.3)  # a GPU that failed is acquired again an interval later
        read()
        read((1, 94), (0, 63))
        source.stop()
        print(json.dumps(found))
        """
    )
    found, stderr = fake_nvml.printed(script, str(Path(__file__).parent), str(fake_nvml.config))
    ups = [[up for up, _ in reading[:2]] for reading in found]
    assert ups == [[True, True], [True, False], [True, False], [True, False], [True, True]] + [
        [True, True]
    ], stderr
    counts = [[xids for _, xids in reading[:2]] for reading in found]
    assert counts == [
        [{"79": 1}, {}],
        [{"79": 1}, {}],
        [{"79": 1, "48": 1}, {}],  # GPU 1's XID 13 went with its registration
        [{"79": 1, "48": 1, "31": 1}, {}],
        [{"79": 1, "48": 1, "31": 1}, {}],
        [{"79": 1, "48": 1, "31": 1, "63": 1}, {"94": 1}],
    ], stderr
    # No wait loops on the error: each read waits once, and twice when it takes an event.
    assert [reading[2] for reading in found] == [2, 1, 2, 2, 1, 3], stderr


def test_a_gpu_lost_and_back_is_named_for_the_pcie_it_cannot_report_now(
    fake_nvml: FakeNvml,
) -> None:
    """The PCIe directions a GPU could not report leave `doctor`'s list with the GPU when it goes
    down, and its first reading back names them again only if it still cannot report them."""
    script = textwrap.dedent(
        """
        import json, sys, time
        from pathlib import Path
        sys.path.insert(0, sys.argv[2])
        from fakenvml import FakeNvml
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        fake = FakeNvml(Path(sys.argv[1]), Path(sys.argv[3]), gpus=2, processes_per_gpu=0)
        fake.gpu(1, not_supported=["pcie_throughput"])
        settings = {"nvml_library": sys.argv[1], "interval": "0.2s"}
        source = NvmlSource(config.load(settings, {}))
        source.start()
        said = []
        for change in ({"lost": True}, {"lost": False, "not_supported": []},
                       {"lost": True}, {"lost": False, "not_supported": ["pcie_throughput"]}):
            reading = source.read()
            said.append([[gpu.up for gpu in reading.gpus], source.describe(reading)])
            fake.gpu(1, **change)
            time.sleep(0.3)  # a GPU that failed is acquired again an interval later
        reading = source.read()
        said.append([[gpu.up for gpu in reading.gpus], source.describe(reading)])
        source.stop()
        print(json.dumps(said))
        """
    )
    found, stderr = fake_nvml.printed(script, str(Path(__file__).parent), str(fake_nvml.config))
    ups = [up for up, _ in found]
    assert ups == [[True, True], [True, False], [True, True], [True, False], [True, True]], stderr
    named = ["GPU 1 cannot report nvlink, pcie_rx, pcie_tx (" in said for _, said in found]
    assert named == [True, False, False, False, True], found
