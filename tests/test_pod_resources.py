"""GPU-to-pod assignment from a fake kubelet pod-resources gRPC server on a unix socket."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml
from fixtures.sysfs import FakeSysfs
from kepler_bridge.kube.client import KubeError
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.kube.pod_resources import list_assignments
from kepler_bridge.kube.view import Assignment
from kepler_bridge.model import PodRef
from kepler_bridge.sources.amdgpu import AmdgpuSource
from kepler_bridge.sources.ascend import AscendSource
from kepler_bridge.sources.command import parse as parse_command
from kepler_bridge.sources.intel import IntelSource
from kubefakes import FakeKube, FakePodResources, list_response, pod, pod_list
from scaffold import by_name, make_config
from test_ascend import fake_npu_smi, table

GPU0 = "GPU-fa4e0000-0000-4000-8000-000000000000"
GPU1 = "GPU-fa4e0000-0000-4000-8000-000000000001"
GIB = 1024**3


ASSIGNED = list_response(
    [
        ("ml", "train-0", [("main", [("nvidia.com/gpu", [GPU0])]), ("logger", [])]),
        ("ml", "infer-a", [("server", [("nvidia.com/gpu", [f"{GPU1}::0"])])]),
        (
            "ml",
            "infer-b",
            [("server", [("nvidia.com/gpu", [f"{GPU1}::1"]), ("example.com/nic", ["eth9"])])],
        ),
    ]
)


def test_list_reads_the_kubelets_wire_format(tmp_path: Path) -> None:
    with FakePodResources(tmp_path / "kubelet.sock", ASSIGNED):
        assert list_assignments(str(tmp_path / "kubelet.sock"), timeout=5, max_bytes=1 << 20) == (
            Assignment(GPU0, "nvidia.com/gpu", PodRef("ml", "train-0", "main")),
            Assignment(f"{GPU1}::0", "nvidia.com/gpu", PodRef("ml", "infer-a", "server")),
            Assignment(f"{GPU1}::1", "nvidia.com/gpu", PodRef("ml", "infer-b", "server")),
            Assignment("eth9", "example.com/nic", PodRef("ml", "infer-b", "server")),
        )


def test_errors_name_the_socket_and_the_fix(tmp_path: Path) -> None:
    with FakePodResources(
        tmp_path / "kubelet.sock", ASSIGNED, service="v1alpha1.PodResourcesLister"
    ):
        with pytest.raises(
            KubeError, match=r"pod-resources .*kubelet.sock: UNIMPLEMENTED.*mount the kubelet's"
        ):
            list_assignments(str(tmp_path / "kubelet.sock"), timeout=5, max_bytes=1 << 20)


def kube(socket: Path) -> KubeMetadata:
    return KubeMetadata(make_config(kube_source="off", pod_resources_socket=socket), environ={})


def test_missing_socket_means_no_assignments_and_no_error(tmp_path: Path) -> None:
    metadata = kube(tmp_path / "absent.sock")
    metadata.refresh()
    assert metadata.view().devices == {} and metadata.errors == {}


def test_last_assignments_kept_while_the_kubelet_restarts(tmp_path: Path) -> None:
    socket = tmp_path / "kubelet.sock"
    metadata = kube(socket)
    with FakePodResources(socket, ASSIGNED) as server:
        metadata.refresh()
        assert server.calls == 1
    owners = metadata.view().devices
    assert owners[GPU0.lower()] == (PodRef("ml", "train-0", "main"),)
    assert len(owners[GPU1.lower()]) == 2
    socket.touch(exist_ok=True)  # the kubelet is gone but its socket file is still there
    started = time.monotonic()
    metadata.refresh()
    assert time.monotonic() - started < 10
    assert (
        metadata.view().devices == owners
        and "keeping the last assignments" in metadata.errors["devices"]
    )


def test_a_finished_pod_still_listed_by_pod_resources_holds_no_device(tmp_path: Path) -> None:
    """pod-resources lists the devices of pods in phase Succeeded or Failed too (kubernetes#119423):
    a Job's card, reassigned when it finished, would have two holders and no one owner."""
    done = pod("ml", "etl-job-x7", ("main", f"containerd://{'1' * 64}"))
    done["status"]["phase"] = "Succeeded"
    running = pod("ml", "train-0", ("main", f"containerd://{'2' * 64}"))
    running["status"]["phase"] = "Running"
    socket, card = tmp_path / "kubelet.sock", "0000:c3:00.0"
    reply = list_response(
        [
            ("ml", "etl-job-x7", [("main", [("amd.com/gpu", [card])])]),
            ("ml", "train-0", [("main", [("amd.com/gpu", [card])])]),
        ]
    )
    with FakeKube(pod_list(done, running)) as server, FakePodResources(socket, reply):
        metadata = KubeMetadata(
            make_config(
                kube_source="metaserver", metaserver_url=server.url, pod_resources_socket=socket
            ),
            environ={},
        )
        metadata.refresh()
    assert metadata.view().devices == {card: (PodRef("ml", "train-0", "main"),)}


def test_each_vendors_plugin_id_finds_the_device_its_source_reads(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.amd_mi210(0, "0000:c3:00.0")
    sysfs.intel_dg2_i915(1, "0000:05:00.0")
    sysfs.intel_bmg_xe(2, "0000:06:00.0")
    npu_smi = fake_npu_smi(tmp_path / "310p", table("310p3"))
    settings = make_config(sysfs=sysfs.root, npu_smi=npu_smi)
    readings = []
    for source in (AmdgpuSource(settings), IntelSource(settings), AscendSource(settings)):
        source.start()
        readings.extend(source.read().gpus)
    readings.extend(
        parse_command(
            json.dumps(
                {
                    "devices": [
                        {"uuid": "KL-R200-01", "vendor": "kunlun"},
                        {"pciBusId": "0000:3b:00.0"},
                    ]
                }
            )
        )
    )
    pod = {
        name: PodRef("ml", name, "main")
        for name in ("amd", "intel", "npu-a", "npu-b", "kunlun", "mlu")
    }
    # The ids each vendor's device plugin puts in pod-resources: AMD the PCI address, Intel the card
    # name with a shared replica number, Ascend <type>-<id> (and a vNPU slice of chip 1), a command
    # device its uuid or bus id.
    response = list_response(
        [
            ("ml", "amd", [("main", [("amd.com/gpu", ["0000:c3:00.0"])])]),
            ("ml", "intel", [("main", [("gpu.intel.com/i915", ["card1-0", "card2-3"])])]),
            ("ml", "npu-a", [("main", [("huawei.com/Ascend310P", ["Ascend310P-0"])])]),
            ("ml", "npu-b", [("main", [("huawei.com/Ascend310P-2c", ["Ascend310P-2c-100-1"])])]),
            ("ml", "kunlun", [("main", [("kunlun.com/xpu", ["KL-R200-01"])])]),
            ("ml", "mlu", [("main", [("cambricon.com/mlu", ["0000:3b:00.0"])])]),
        ]
    )
    metadata = kube(tmp_path / "kubelet.sock")
    with FakePodResources(tmp_path / "kubelet.sock", response):
        metadata.refresh()
    owners = {gpu.uuid: metadata.view().gpu_owners(gpu) for gpu in readings}
    assert owners == {
        "AMD-b2c8a7e2f3d41c8f": (pod["amd"],),
        "INTEL-0000:05:00.0": (pod["intel"],),
        "INTEL-0000:06:00.0": (pod["intel"],),
        "ASCEND-0000:01:00.0-0": (pod["npu-a"],),
        "ASCEND-0000:02:00.0-0": (pod["npu-b"],),
        "KL-R200-01": (pod["kunlun"],),
        "custom-1": (pod["mlu"],),
    }
    assert not any(gpu.lists_processes for gpu in readings)


@pytest.mark.e2e
def test_agent_names_the_pod_a_gpu_is_assigned_to_in_gpu_pod_info(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    socket = tmp_path / "kubelet.sock"
    fake_nvml.processes(0, [{"pid": 999001, "used_memory": 2 * GIB, "sm_util": 60}])
    fake_nvml.processes(1, [{"pid": 999002, "used_memory": GIB, "sm_util": 20}])
    with (
        FakePodResources(socket, ASSIGNED),
        Agent(
            "--sources",
            "nvml",
            "--nvml-library",
            str(fake_nvml.library),
            "--interval",
            "200ms",
            "--kube-source",
            "off",
            "--pod-resources-socket",
            str(socket),
            "--gpu-idle-watts",
            "100",
            "--process-metrics",
            "all",
            env=fake_nvml.env(),
        ) as agent,
    ):

        def pod_energy() -> dict:
            nonlocal energy
            found = by_name(agent.metrics())
            pods = {
                labels["pod"]: value
                for labels, value in found.get("kepler_bridge_pod_gpu_joules_total", [])
            }
            if pods.get("train-0", 0) > 0:
                return found
            energy += 50_000  # 50 J per poll, 0.1 s apart: 500 W on GPU 0
            fake_nvml.gpu(0, total_energy=energy)
            return {}

        energy = 1_000_000_000
        found = agent.wait_for(pod_energy, what="GPU energy of pod train-0")
    owners = {
        labels["gpu"]: (labels["namespace"], labels["pod"], labels["container"], value)
        for labels, value in found["gpu_pod_info"]
    }
    assert owners == {
        "0": ("ml", "train-0", "main", 1.0)
    }  # GPU 1 is shared by two pods: no single owner
    # Device series keep the same labels whoever owns the GPU,
    # so the owner changing never starts a new series.
    for name in ("gpu_up", "gpu_energy_joules_total", "kepler_bridge_node_gpu_idle_joules_total"):
        assert [set(labels) for labels, _ in found[name]] == [
            {"node", "gpu", "uuid", "vendor", "model"}
        ] * 2, name
    processes = {
        labels["pid"]: (labels["namespace"], labels["pod"], labels["container"])
        for labels, _ in found["gpu_process_memory_used_bytes"]
    }
    # The agent cannot see these pids in /proc: each gets its GPU's owner when there is exactly one.
    assert processes == {"999001": ("ml", "train-0", "main"), "999002": ("", "", "")}
    process_energy = {
        labels["pid"]: labels["pod"]
        for labels, _ in found["kepler_bridge_process_gpu_joules_total"]
    }
    assert process_energy["999001"] == "train-0"
