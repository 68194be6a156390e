"""GPU-to-pod assignment from a fake kubelet pod-resources gRPC server on a unix socket."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import Agent
from fakenvml import FakeNvml
from kepler_bridge import config
from kepler_bridge.kube.client import KubeError
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.kube.pod_resources import list_assignments
from kepler_bridge.kube.view import Assignment
from kepler_bridge.model import PodRef

GPU0 = "GPU-fa4e0000-0000-4000-8000-000000000000"
GPU1 = "GPU-fa4e0000-0000-4000-8000-000000000001"
GIB = 1024**3


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand so the test does not trust the agent's schema."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def list_response(pods: list[tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]]) -> bytes:
    """ListPodResourcesResponse with k8s.io/kubelet's field numbers, plus fields the agent does not read
    (cpu_ids, memory, topology), which it must skip."""
    body = b""
    for namespace, name, containers in pods:
        pod = _field(1, name.encode()) + _field(2, namespace.encode())
        for container_name, devices in containers:
            container = _field(1, container_name.encode())
            for resource, ids in devices:
                device = _field(1, resource.encode()) + b"".join(_field(2, i.encode()) for i in ids)
                container += _field(2, device + _field(3, _field(1, _varint(1 << 3) + _varint(0))))  # topology
            container += _field(3, _varint(4) + _varint(5))  # cpu_ids, packed
            container += _field(4, _field(1, b"memory") + _varint(2 << 3) + _varint(1 << 30))  # memory
            pod += _field(3, container)
        body += _field(1, pod)
    return body


class FakePodResources:
    """v1.PodResourcesLister/List on a unix socket, answering `response` (bytes)."""

    def __init__(self, socket: Path, response: bytes, service: str = "v1.PodResourcesLister") -> None:
        self.socket = socket
        self.response = response
        self.calls = 0
        self._lock = threading.Lock()

        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls += 1
            return self.response

        handler = grpc.method_handlers_generic_handler(service, {"List": grpc.unary_unary_rpc_method_handler(answer)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)

    def __enter__(self) -> "FakePodResources":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


ASSIGNED = list_response([
    ("ml", "train-0", [("main", [("nvidia.com/gpu", [GPU0])]), ("logger", [])]),
    ("ml", "infer-a", [("server", [("nvidia.com/gpu", [f"{GPU1}::0"])])]),
    ("ml", "infer-b", [("server", [("nvidia.com/gpu", [f"{GPU1}::1"]), ("example.com/nic", ["eth9"])])]),
])


def test_list_reads_the_kubelets_wire_format(tmp_path: Path) -> None:
    with FakePodResources(tmp_path / "kubelet.sock", ASSIGNED):
        assert list_assignments(str(tmp_path / "kubelet.sock"), timeout=5) == (
            Assignment(GPU0, "nvidia.com/gpu", PodRef("ml", "train-0", "main")),
            Assignment(f"{GPU1}::0", "nvidia.com/gpu", PodRef("ml", "infer-a", "server")),
            Assignment(f"{GPU1}::1", "nvidia.com/gpu", PodRef("ml", "infer-b", "server")),
            Assignment("eth9", "example.com/nic", PodRef("ml", "infer-b", "server")))


def test_errors_name_the_socket_and_the_fix(tmp_path: Path) -> None:
    with FakePodResources(tmp_path / "kubelet.sock", ASSIGNED, service="v1alpha1.PodResourcesLister"):
        with pytest.raises(KubeError, match=r"pod-resources .*kubelet.sock: UNIMPLEMENTED.*mount the kubelet's"):
            list_assignments(str(tmp_path / "kubelet.sock"), timeout=5)


def kube(socket: Path) -> KubeMetadata:
    return KubeMetadata(config.load({"kube_source": "off", "pod_resources_socket": str(socket)}, {}), environ={})


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
    assert metadata.view().devices == owners and "keeping the last assignments" in metadata.errors["devices"]


def families(agent: Agent) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(agent.metrics()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_agent_labels_gpu_series_with_the_assigned_pod(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    socket = tmp_path / "kubelet.sock"
    fake_nvml.processes(0, [{"pid": 999001, "used_memory": 2 * GIB, "sm_util": 60}])
    fake_nvml.processes(1, [{"pid": 999002, "used_memory": GIB, "sm_util": 20}])
    with FakePodResources(socket, ASSIGNED), \
            Agent("--sources", "nvml", "--nvml-library", str(fake_nvml.library), "--interval", "200ms",
                  "--kube-source", "off", "--pod-resources-socket", str(socket), "--gpu-idle-watts", "100",
                  "--process-metrics", "all", env=fake_nvml.env()) as agent:
        def pod_energy() -> dict:
            found = families(agent)
            pods = {labels["pod"]: value for labels, value in found.get("kepler_bridge_pod_gpu_joules_total", [])}
            return found if pods.get("train-0", 0) > 0 else {}

        energy = 1_000_000_000
        deadline = time.monotonic() + 10
        while not (found := pod_energy()) and time.monotonic() < deadline:
            energy += 50_000  # 50 J per 0.1 s: 500 W on GPU 0
            fake_nvml.gpu(0, total_energy=energy)
            time.sleep(0.1)
        assert found, agent.output()[-2000:]
    up = {labels["gpu"]: labels for labels, _ in found["gpu_up"]}
    assert (up["0"]["namespace"], up["0"]["pod"], up["0"]["container"]) == ("ml", "train-0", "main")
    assert (up["1"]["namespace"], up["1"]["pod"]) == ("", "")  # shared by two pods: no single owner
    idle = {labels["gpu"]: labels["pod"] for labels, _ in found["kepler_bridge_node_gpu_idle_joules_total"]}
    assert idle == {"0": "train-0", "1": ""}
    processes = {labels["pid"]: (labels["namespace"], labels["pod"], labels["container"])
                 for labels, _ in found["gpu_process_memory_used_bytes"]}
    # The agent cannot see these pids in /proc: each gets its GPU's owner when there is exactly one.
    assert processes == {"999001": ("ml", "train-0", "main"), "999002": ("", "", "")}
    process_energy = {labels["pid"]: labels["pod"] for labels, _ in found["kepler_bridge_process_gpu_joules_total"]}
    assert process_energy["999001"] == "train-0"
