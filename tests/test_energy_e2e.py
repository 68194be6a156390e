"""Energy attribution through the real agent: CPU energy split by CPU time, GPU energy split by SM
utilization, a device without process data booked to the container that holds it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from agent import Agent
from fakenvml import FakeNvml
from fixtures.sysfs import FakeSysfs
from kubefakes import FakePodResources, list_response
from powercap import PowercapTree
from scaffold import by_name

GIB = 1024**3

# On a newline, uses `rate` CPUs for `seconds` in bursts of about 5 ms (catching up if it got
# less), prints done.
_PACED_BURN = """
import sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
sys.stdin.readline()
start, cpu0 = time.monotonic(), time.process_time()
while (used := time.process_time() - cpu0) < rate * seconds:
    ahead = used - rate * (time.monotonic() - start)
    if ahead > 0.005:
        time.sleep(ahead / rate)
print("done", flush=True)
sys.stdin.readline()
"""


pytestmark = pytest.mark.e2e


class PacedBurner:
    """A child that, once started, uses a steady fraction of one CPU for a given time."""

    def __init__(self, rate: float, seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-c", _PACED_BURN, str(rate), str(seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = str(self.process.pid)

    def start(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def wait(self) -> None:
        assert self.process.stdout.readline() == "done\n"

    def __enter__(self) -> "PacedBurner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()
        self.process.wait(10)


def scrape(agent: Agent) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One /metrics answer (one snapshot): sample name -> [(labels, value)]."""
    return by_name(agent.metrics())


def series(agent: Agent, name: str) -> list[tuple[dict[str, str], float]]:
    return scrape(agent).get(name, [])


def by(label: str, samples: list[tuple[dict[str, str], float]]) -> dict[str, float]:
    return {labels[label]: value for labels, value in samples}


def by_pid(agent: Agent, name: str) -> dict[str, float]:
    return by("pid", series(agent, name))


def test_cpu_energy_split_3_to_1_by_cpu_time(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    # A 120 J range at 100 W wraps every 1.2 s (a hardware counter wraps after minutes; an interval
    # must stay shorter than one turn): the split must survive several wrap-arounds.
    tree.zone("intel-rapl:0", "package-0", 0, max_energy_range_uj=120_000_000)
    tree.zone("intel-rapl:0:0", "core", 0)
    with (
        tree.drawing("intel-rapl:0", watts=100.0, step=0.002),
        Agent(
            "--sources",
            "procfs,rapl",
            "--sysfs",
            str(tree.sysfs),
            "--interval",
            "500ms",
            "--process-metrics",
            "all",
        ) as agent,
        PacedBurner(0.6, 4.0) as heavy,
        PacedBurner(0.2, 4.0) as light,
    ):
        agent.wait_for(
            lambda: (
                {heavy.pid, light.pid}
                <= set(by_pid(agent, "kepler_bridge_process_cpu_joules_total"))
            ),
            what="both burners have CPU energy series",
        )
        before = scrape(agent)
        heavy.start()
        light.start()
        heavy.wait()
        light.wait()
        # Two samples past the end, so the last CPU time is attributed. Per-interval CPU times
        # are whole clock ticks: intervals of several ticks keep that rounding small next to the
        # 5 % allowed.
        time.sleep(1.2)
        after = scrape(agent)

    def gain(name: str, label: str, key: str) -> float:
        return by(label, after[name])[key] - by(label, before[name])[key]

    joules = {
        pid: gain("kepler_bridge_process_cpu_joules_total", "pid", pid)
        for pid in (heavy.pid, light.pid)
    }
    seconds = {
        pid: gain("kepler_bridge_process_cpu_seconds_total", "pid", pid)
        for pid in (heavy.pid, light.pid)
    }
    assert seconds[heavy.pid] == pytest.approx(2.4, rel=0.05) and seconds[
        light.pid
    ] == pytest.approx(0.8, rel=0.05)
    assert joules[heavy.pid] / joules[light.pid] == pytest.approx(3.0, rel=0.05), (joules, seconds)
    package = gain("kepler_bridge_node_cpu_joules_total", "zone", "package")
    assert package > 400.0  # 4 s at 100 W, through several wrap-arounds
    assert sum(joules.values()) < package
    assert {labels["source"] for labels, _ in after["kepler_bridge_node_cpu_joules_total"]} == {
        "rapl"
    }
    assert {labels["zone"] for labels, _ in after["kepler_bridge_node_cpu_joules_total"]} == {
        "package",
        "core",
    }


def test_cpu_energy_series_absent_without_rapl(tmp_path: Path) -> None:
    (tmp_path / "sys" / "class" / "powercap").mkdir(parents=True)
    with Agent(
        "--sources",
        "procfs,rapl",
        "--sysfs",
        str(tmp_path / "sys"),
        "--interval",
        "200ms",
        ready=True,
    ) as agent:
        text = agent.metrics()
        assert "kepler_bridge_process_cpu_seconds_total" in text
        assert "_cpu_joules_total" not in text
        up = {labels["source"]: value for labels, value in series(agent, "kepler_bridge_source_up")}
        assert up == {"procfs": 1.0}, "a node without RAPL has no rapl source to be down"
        assert agent.source_states() == {"procfs": "up", "rapl": "absent"}


@contextmanager
def drawing(
    write: Callable[[float], None], joules: float, watts: float, step: float = 0.1
) -> Iterator[None]:
    """While the block runs, write(counter) every `step` seconds, the counter (J) rising from
    `joules` at `watts`."""
    stop = threading.Event()

    def run() -> None:
        counter, last = joules, time.monotonic()
        while not stop.wait(step):
            now = time.monotonic()
            counter += watts * (now - last)
            last = now
            write(counter)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def gpu_drawing(fake: FakeNvml, index: int, watts: float) -> Iterator[None]:
    """Advance a fake GPU's energy counter (mJ) at `watts` while the block runs."""
    return drawing(
        lambda joules: fake.gpu(index, total_energy=int(joules * 1000)),
        fake.gpus[index]["total_energy"] / 1000,
        watts,
    )


def test_gpu_energy_split_3_to_1_by_sm_utilization(fake_nvml: FakeNvml) -> None:
    fake_nvml.processes(
        0,
        [
            {"pid": 999001, "used_memory": 2 * GIB, "sm_util": 60},
            {"pid": 999002, "used_memory": GIB, "sm_util": 20},
        ],
    )
    fake_nvml.processes(1, [])
    fake_nvml.gpu(0, power_usage=250_000)
    with (
        gpu_drawing(fake_nvml, 0, watts=250.0),
        Agent(
            "--sources",
            "nvml",
            "--nvml-library",
            str(fake_nvml.library),
            "--interval",
            "200ms",
            "--gpu-idle-watts",
            "50",
            "--process-metrics",
            "all",
            env=fake_nvml.env(),
        ) as agent,
    ):
        agent.wait_for(
            lambda: all(
                by_pid(agent, "kepler_bridge_process_gpu_joules_total").get(pid, 0) > 0
                for pid in ("999001", "999002")
            ),
            what="GPU energy for both processes",
        )
        before = scrape(agent)
        time.sleep(2.0)
        after = scrape(agent)

    def gain(name: str, label: str, key: str) -> float:
        return by(label, after[name])[key] - by(label, before[name])[key]

    gained = {
        pid: gain("kepler_bridge_process_gpu_joules_total", "pid", pid)
        for pid in ("999001", "999002")
    }
    assert gained["999001"] / gained["999002"] == pytest.approx(3.0, rel=0.05), gained
    idle = gain("kepler_bridge_node_gpu_idle_joules_total", "gpu", "0")
    total = gain("gpu_energy_joules_total", "gpu", "0")
    assert total > 300  # 2 s at 250 W
    # Idle is 50 W of the 250 W; what the processes got plus the idle part is the GPU's energy.
    assert idle / total == pytest.approx(0.2, rel=0.1)
    assert sum(gained.values()) + idle == pytest.approx(total, rel=1e-6)
    # GPU 1 has no process and its counter stands still: no energy, no idle energy.
    assert by("gpu", after["kepler_bridge_node_gpu_idle_joules_total"])["1"] == 0.0
    assert [labels["pod"] for labels, _ in after["kepler_bridge_pod_gpu_joules_total"]] == [""]


def write_microjoules(path: Path) -> Callable[[float], None]:
    """A writer of a hwmon energy file (µJ) that replaces it whole, so the agent never reads
    half a number."""

    def write(joules: float) -> None:
        partial = path.with_name(f".{path.name}")
        partial.write_text(f"{round(joules * 1e6)}\n")
        os.replace(partial, path)

    return write


def test_an_amd_card_without_process_data_gives_the_pod_holding_it_its_energy_above_idle(
    tmp_path: Path,
) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    owned = sysfs.amd_mi210(0, "0000:c3:00.0")  # has an energy counter, drawn at 250 W below
    sysfs.amd_rx7900(1, "0000:03:00.0")  # no counter: power1_input 65 W all along
    (energy_file,) = (owned / "device" / "hwmon").glob("hwmon*/energy1_input")
    socket = tmp_path / "kubelet.sock"
    # AMD's device plugin names a card by its PCI address; the second card is handed to two pods.
    assigned = list_response(
        [
            ("ml", "train-0", [("main", [("amd.com/gpu", ["0000:c3:00.0"])])]),
            ("ml", "infer-a", [("server", [("amd.com/gpu", ["0000:03:00.0"])])]),
            ("ml", "infer-b", [("server", [("amd.com/gpu", ["0000:03:00.0"])])]),
        ]
    )
    with (
        FakePodResources(socket, assigned),
        drawing(write_microjoules(energy_file), int(energy_file.read_text()) / 1e6, watts=250.0),
        Agent(
            "--sources",
            "amdgpu",
            "--sysfs",
            str(sysfs.root),
            "--interval",
            "200ms",
            "--kube-source",
            "off",
            "--pod-resources-socket",
            str(socket),
            "--gpu-idle-watts",
            "50",
        ) as agent,
    ):
        agent.wait_for(
            lambda: (
                by("pod", series(agent, "kepler_bridge_pod_gpu_joules_total")).get("train-0", 0) > 0
            ),
            what="GPU energy for the pod holding card 0",
        )
        before = scrape(agent)
        time.sleep(1.5)
        after = scrape(agent)

    def gain(name: str, label: str, key: str) -> float:
        return by(label, after[name])[key] - by(label, before[name])[key]

    def unattributed(samples: list[tuple[dict[str, str], float]]) -> dict[tuple[str, str], float]:
        return {(labels["gpu"], labels["reason"]): value for labels, value in samples}

    pod = gain("kepler_bridge_pod_gpu_joules_total", "pod", "train-0")
    idle = {gpu: gain("kepler_bridge_node_gpu_idle_joules_total", "gpu", gpu) for gpu in ("0", "1")}
    lost = {
        key: value - unattributed(before["kepler_bridge_node_gpu_unattributed_joules_total"])[key]
        for key, value in unattributed(
            after["kepler_bridge_node_gpu_unattributed_joules_total"]
        ).items()
    }
    total = gain("gpu_energy_joules_total", "gpu", "0")
    assert total > 250  # 1.5 s at 250 W
    assert pod > idle["0"]  # 200 of the 250 W are above the 50 W idle
    # Card 0: its whole energy is idle or its pod's; card 1: 15 of its 65 W are active, but
    # whose is unknown.
    assert idle["0"] + pod == pytest.approx(total, rel=1e-6)
    assert lost == {
        ("0", "shared"): 0.0,
        ("0", "no_owner"): 0.0,
        ("1", "shared"): pytest.approx(idle["1"] * 15 / 50),
        ("1", "no_owner"): 0.0,
    }
    assert [labels["pod"] for labels, _ in after["kepler_bridge_pod_gpu_joules_total"]] == [
        "train-0"
    ]
    assert [
        (labels["container_id"], labels["container"])
        for labels, _ in after["kepler_bridge_container_gpu_joules_total"]
    ] == [("", "main")]
    assert "kepler_bridge_process_gpu_joules_total" not in after
    assert [(labels["gpu"], labels["pod"]) for labels, _ in after["gpu_pod_info"]] == [
        ("0", "train-0")
    ]


@pytest.mark.parametrize("names", ["kepler", "dcgm"])
def test_only_processes_with_gpu_energy_have_gpu_energy_series(
    fake_nvml: FakeNvml, names: str
) -> None:
    # One process on GPU 0; the host's other processes (kthreadd, kworkers, this test) never
    # touched a GPU.
    fake_nvml.processes(0, [{"pid": 999001, "used_memory": GIB, "sm_util": 50}])
    fake_nvml.processes(1, [])
    with (
        gpu_drawing(fake_nvml, 0, watts=250.0),
        Agent(
            "--sources",
            "nvml,procfs",
            "--nvml-library",
            str(fake_nvml.library),
            "--interval",
            "200ms",
            "--gpu-idle-watts",
            "50",
            "--process-metrics",
            "all",
            "--metric-names",
            names,
            env=fake_nvml.env(),
        ) as agent,
    ):
        gpu = agent.wait_for(
            lambda: by_pid(agent, "kepler_bridge_process_gpu_joules_total"),
            what="a process GPU energy series",
        )
        found = scrape(agent)
    assert set(gpu) == {"999001"} and gpu["999001"] > 0, gpu
    assert len(by("pid", found["kepler_bridge_process_cpu_seconds_total"])) > 10
    # The GPU process runs on the host: the host's container ("") and pod ("") have its energy.
    for level in ("container", "pod"):
        rows = found[f"kepler_bridge_{level}_gpu_joules_total"]
        assert [value > 0 for _, value in rows] == [True], (level, rows)
