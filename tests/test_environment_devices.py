"""Without pod-resources (KubeEdge), a container's devices come from its processes' environment:
the variables as the runtimes read them, real child processes matched to containers, hostile
environs, and the agent naming the pods with source="environment"."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import Agent
from fakenvml import FakeNvml
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.kube.view import KubeView
from kepler_bridge.kube.visible_devices import (
    MAX_TOKEN,
    NO_DEVICES,
    VisibleDevices,
    named,
    parse_environ,
)
from kepler_bridge.model import GpuReading, MigInstance, PodRef
from kepler_bridge.sampling import environment
from kepler_bridge.sampling.environment import EnvironmentDevices
from kubeedge_rig import AMD, GPU0, child, kubeedge_rig, no_owner
from kubefakes import FakePodResources, list_response
from scaffold import by_name, make_config
from test_energy_e2e import by

GPU = [f"GPU-fa4e0000-0000-4000-8000-{index:012x}" for index in range(3)]
MIG = "MIG-4f1c0000-0000-4000-8000-000000000001"
GPUS = (
    GpuReading(0, GPU[0], "nvidia", "A100"),
    GpuReading(
        1, GPU[1], "nvidia", "A100", mig_instances=(MigInstance(1, 0, MIG),), mig_uuids=(MIG,)
    ),
    GpuReading(2, GPU[2], "nvidia", "A100"),
    GpuReading(0, "AMD-b2c8a7e2f3d41c8f", "amd", "MI210"),
    GpuReading(0, "ASCEND-0000:01:00.0-0", "huawei", "310P3", device_ids=("Ascend310P-4",)),
)


def environ(**variables: str) -> bytes:
    return b"".join(f"{name}={value}".encode() + b"\0" for name, value in variables.items())


def keys(**variables: str) -> tuple[set[str], bool]:
    found, by_all = named(parse_environ(environ(PATH="/usr/bin", **variables)), GPUS)
    return set(found), by_all


def test_nvidia_visible_devices_reads_as_the_container_toolkit_reads_it() -> None:
    assert keys(NVIDIA_VISIBLE_DEVICES=GPU[0]) == ({GPU[0].lower()}, False)
    assert keys(NVIDIA_VISIBLE_DEVICES=f" {GPU[2]} , 0") == (
        {GPU[2].lower(), GPU[0].lower()},
        False,
    )
    assert keys(NVIDIA_VISIBLE_DEVICES="1:0") == ({MIG.lower()}, False)  # MIG device 0 of GPU 1
    assert keys(NVIDIA_VISIBLE_DEVICES=MIG) == ({MIG.lower()}, False)
    assert keys(NVIDIA_VISIBLE_DEVICES="all") == ({gpu.lower() for gpu in GPU}, True)
    for nothing in ("none", "void", "", "7", "1:5"):  # no such GPU or MIG device: nothing
        assert keys(NVIDIA_VISIBLE_DEVICES=nothing) == (set(), False), nothing
    assert keys() == (set(), False)


def test_cuda_uuids_narrow_or_stand_alone_and_its_indexes_are_not_trusted() -> None:
    assert keys(NVIDIA_VISIBLE_DEVICES="all", CUDA_VISIBLE_DEVICES=GPU[1]) == (
        {GPU[1].lower()},
        False,
    )
    assert keys(NVIDIA_VISIBLE_DEVICES=GPU[0], CUDA_VISIBLE_DEVICES=GPU[1]) == (set(), False)
    assert keys(NVIDIA_VISIBLE_DEVICES="1", CUDA_VISIBLE_DEVICES=MIG) == ({MIG.lower()}, False)
    assert keys(CUDA_VISIBLE_DEVICES=GPU[2]) == ({GPU[2].lower()}, False)  # privileged container
    # Indexes are the container's own order: GPU 0 inside may be any GPU of the node.
    assert keys(CUDA_VISIBLE_DEVICES="0") == (set(), False)
    assert keys(NVIDIA_VISIBLE_DEVICES=GPU[2], CUDA_VISIBLE_DEVICES="0") == (
        {GPU[2].lower()},
        False,
    )
    assert keys(CUDA_VISIBLE_DEVICES=f"{GPU[0]},1") == (set(), False)


def test_ascend_ids_and_rocm_uuids() -> None:
    assert keys(ASCEND_VISIBLE_DEVICES="0-5") == ({"ascend-0000:01:00.0-0"}, False)
    assert keys(ASCEND_VISIBLE_DEVICES="1,2") == (set(), False)
    assert keys(ROCR_VISIBLE_DEVICES="GPU-B2C8A7E2F3D41C8F") == ({"amd-b2c8a7e2f3d41c8f"}, False)
    assert keys(HIP_VISIBLE_DEVICES="GPU-b2c8a7e2f3d41c8f") == ({"amd-b2c8a7e2f3d41c8f"}, False)
    assert keys(ROCR_VISIBLE_DEVICES="0") == (set(), False)


def test_the_first_of_a_repeated_name_counts_and_a_cut_value_loses_its_last_token() -> None:
    data = environ(NVIDIA_VISIBLE_DEVICES="0") + environ(NVIDIA_VISIBLE_DEVICES="2")
    assert parse_environ(data).nvidia == ("0",)
    assert parse_environ(b"XNVIDIA_VISIBLE_DEVICES=1\0").nvidia == ()
    huge = ",".join(["1"] * 30_000) + ",12"  # past the value's bound: "12" must not become "1"
    assert set(parse_environ(environ(NVIDIA_VISIBLE_DEVICES=huge)).nvidia) == {"1"}


visible_names = st.sampled_from(
    [b"NVIDIA_VISIBLE_DEVICES", b"CUDA_VISIBLE_DEVICES", b"ASCEND_VISIBLE_DEVICES"]
    + [b"ROCR_VISIBLE_DEVICES", b"HIP_VISIBLE_DEVICES", b"PATH", b""]
)
hostile_values = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([GPU[0], "0", "1:0", "all", "0-999", "\udcff", ",", "GPU-"]))
    .map(",".join)
    .map(lambda text: text.encode("utf-8", "surrogateescape")),
    st.integers(1, 100_000).map(lambda size: b"GPU-" + b"a" * size),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(visible_names, st.sampled_from([b"=", b"", b"=="]), hostile_values)))
def test_hostile_environs_never_raise_and_stay_bounded(
    entries: list[tuple[bytes, bytes, bytes]],
) -> None:
    data = b"\0".join(name + equals + value for name, equals, value in entries)
    visible = parse_environ(data)
    assert isinstance(visible, VisibleDevices)
    for tokens in (visible.nvidia, visible.cuda, visible.rocm):
        assert len(tokens) <= 256 and all(len(token) <= MAX_TOKEN for token in tokens)
    assert len(visible.ascend) <= 256
    found, _ = named(visible, GPUS)
    assert len(found) <= len(GPUS) + 1 + len(visible.nvidia) + len(visible.cuda) + len(visible.rocm)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.binary(max_size=2000), hostile_values), min_size=1, max_size=12))
def test_hostile_environ_files_give_a_view_and_cost_one_read_each(files: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        for pid, data in enumerate(files, start=1):
            (Path(directory) / str(pid)).mkdir()
            (Path(directory) / str(pid) / "environ").write_bytes(data)
        containers = {f"c{pid}": POD["train"] for pid in range(1, len(files) + 1)}
        learned = EnvironmentDevices(directory, container_of=lambda pid: f"c{pid}")
        rows = [(pid, "x", f"c{pid}") for pid in range(1, len(files) + 1)]
        for _ in range(environment.MAX_TRIES * 2 + 2):
            view = learned.view(learning(containers), set(containers), rows, GPUS)
            assert all(len(view.holders(gpu)) <= len(files) for gpu in GPUS)
        # An empty environ is tried again (a process in exec), up to MAX_TRIES; others once.
        assert learned.reads == sum(environment.MAX_TRIES if not data else 1 for data in files)


def test_a_million_nuls_cost_no_list_of_entries() -> None:
    assert parse_environ(b"\0" * (1 << 20)) == NO_DEVICES


def test_an_environ_past_the_bound_loses_its_cut_entry_not_a_digit(tmp_path: Path) -> None:
    """`NVIDIA_VISIBLE_DEVICES=12` cut after its "1" by the read's bound must not name GPU 1."""
    cut = b"\0NVIDIA_VISIBLE_DEVICES=1"
    padding = b"PAD=" + b"x" * (environment.MAX_ENVIRON_BYTES - len(cut) - 4)
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "environ").write_bytes(padding + cut + b"2\0")
    learned = EnvironmentDevices(str(tmp_path), container_of=lambda pid: "c1")
    kube = learning({"c1": POD["train"]})
    assert learned.view(kube, {"c1"}, [(7, "x", "c1")], GPUS) is kube
    assert learned.reads == 1


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


POD = {name: PodRef("ml", name, "main") for name in ("train", "infer", "monitor", "plugin")}


def learning(containers: dict[str, PodRef]) -> KubeView:
    return KubeView(containers, learn_from_environment=True)


def owners(view: KubeView) -> dict[str, tuple[tuple[str, str], ...]]:
    return {
        gpu.uuid: tuple((holder.owner.pod, holder.source) for holder in view.holders(gpu))
        for gpu in GPUS
    }


def test_real_processes_give_their_containers_devices(children: list[subprocess.Popen]) -> None:
    pids = {
        "c-train": child(children, NVIDIA_VISIBLE_DEVICES=GPU[0]),
        "c-infer": child(
            children, NVIDIA_VISIBLE_DEVICES="1", ROCR_VISIBLE_DEVICES="GPU-b2c8a7e2f3d41c8f"
        ),
        "c-monitor": child(children, NVIDIA_VISIBLE_DEVICES="all"),
    }
    container = {pid: cid for cid, pid in pids.items()}
    learned = EnvironmentDevices("/proc", container_of=container.get)
    kube = learning({f"c-{name}": pod for name, pod in POD.items()})
    rows = [(pid, "python3", cid) for cid, pid in pids.items()]
    view = learned.view(kube, set(pids), rows, GPUS)
    env = "environment"
    assert owners(view) == {
        GPU[0]: (("train", env),),
        GPU[1]: (("infer", env),),
        GPU[2]: (("monitor", env),),  # named by no container: the one that has `all` holds it
        "AMD-b2c8a7e2f3d41c8f": (("infer", env),),
        "ASCEND-0000:01:00.0-0": (),
    }
    assert learned.reads == 3
    for _ in range(100):  # read once per container: later samples open nothing
        assert learned.view(kube, set(pids), rows, GPUS) is view
    assert learned.reads == 3
    children[0].kill()
    children[0].wait()
    del pids["c-train"]  # its container went: forgotten, and GPU 0 is the monitor's now
    view = learned.view(kube, set(pids), rows[1:], GPUS)
    assert owners(view)[GPU[0]] == (("monitor", env),)
    assert learned.reads == 3


def test_unreadable_gone_and_reused_pids_are_tried_again_then_given_up(
    children: list[subprocess.Popen], tmp_path: Path
) -> None:
    good = child(children, NVIDIA_VISIBLE_DEVICES=GPU[0])
    kube = learning({"c1": POD["train"]})
    # Pid 1 reads, but is not the container's (a reused pid): the next sample tries the next pid.
    learned = EnvironmentDevices("/proc", container_of=lambda pid: "c1" if pid == good else "c2")
    rows = [(1, "init", "c1"), (good, "python3", "c1")]
    assert learned.view(kube, {"c1"}, rows, GPUS) is kube
    assert owners(learned.view(kube, {"c1"}, rows, GPUS))[GPU[0]] == (("train", "environment"),)
    assert learned.reads == 2
    # A container none of whose pids can be read counts as holding nothing, and is let be.
    procfs = tmp_path / "proc"
    for pid in (6, 7, 8):
        (procfs / str(pid)).mkdir(parents=True)
        (procfs / str(pid) / "environ").mkdir()  # reading it fails: EISDIR
    hidden = EnvironmentDevices(str(procfs), container_of=lambda pid: "c1")
    rows = [(pid, "x", "c1") for pid in (5, 6, 7, 8)]  # pid 5 has gone: no /proc entry
    for _ in range(10):
        assert hidden.view(kube, {"c1"}, rows, GPUS) is kube
    assert hidden.reads == environment.MAX_TRIES
    # Its only process caught in exec (an empty environ): the next sample reads it again.
    (procfs / "20").mkdir()
    (procfs / "20" / "environ").write_bytes(b"")
    execing = EnvironmentDevices(str(procfs), container_of=lambda pid: "c1")
    assert execing.view(kube, {"c1"}, [(20, "sh", "c1")], GPUS) is kube
    (procfs / "20" / "environ").write_bytes(environ(NVIDIA_VISIBLE_DEVICES="2"))
    view = execing.view(kube, {"c1"}, [(20, "sh", "c1")], GPUS)
    assert owners(view)[GPU[2]] == (("train", "environment"),)


def test_at_most_max_reads_containers_a_sample(tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    containers = {f"c{n:03d}": PodRef("ml", f"p{n}", "main") for n in range(50)}
    for n in range(50):
        (procfs / str(100 + n)).mkdir(parents=True)
        (procfs / str(100 + n) / "environ").write_bytes(environ(NVIDIA_VISIBLE_DEVICES=str(n % 3)))
    learned = EnvironmentDevices(str(procfs), container_of=lambda pid: f"c{pid - 100:03d}")
    rows = [(100 + n, "x", f"c{n:03d}") for n in range(50)]
    samples = 0
    while learned.reads < 50:
        before = learned.reads
        learned.view(learning(containers), set(containers), rows, GPUS)
        assert learned.reads - before <= environment.MAX_READS
        samples += 1
    assert samples == -(-50 // environment.MAX_READS)


def test_pod_resources_wins_and_the_environment_fills_in_only_while_it_does_not_answer(
    children: list[subprocess.Popen], tmp_path: Path
) -> None:
    pids = {"c-train": child(children, NVIDIA_VISIBLE_DEVICES=f"{GPU[0]},{GPU[1]}")}
    socket = tmp_path / "kubelet.sock"
    metadata = KubeMetadata(make_config(kube_source="off", pod_resources_socket=socket), environ={})
    learned = EnvironmentDevices("/proc", container_of={pids["c-train"]: "c-train"}.get)

    def sample() -> dict[str, tuple[tuple[str, str], ...]]:
        kube = metadata.view()
        kube = KubeView({"c-train": POD["train"]}, kube.devices, kube.learn_from_environment)
        return owners(learned.view(kube, set(pids), [(pids["c-train"], "x", "c-train")], GPUS))

    metadata.refresh()  # no socket at all, as under EdgeCore
    assert metadata.view().learn_from_environment
    with FakePodResources(
        socket, list_response([("ml", "infer", [("main", [("nvidia.com/gpu", [GPU[0]])])])])
    ):
        metadata.refresh()
        answered = sample()
    assert answered[GPU[0]] == (("infer", "pod-resources"),) and answered[GPU[1]] == ()
    assert learned.reads == 0  # pod-resources answered: no environ is read
    socket.touch(exist_ok=True)  # the kubelet is gone but its socket file stays
    metadata.refresh()
    failing = sample()
    assert failing[GPU[0]] == (("infer", "pod-resources"),)  # its last answer still wins
    assert failing[GPU[1]] == (("train", "environment"),)


@pytest.mark.e2e
def test_agent_on_a_node_without_pod_resources_names_the_pods_from_their_environment(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """As on KubeEdge (kubeedge_rig): the pods' devices are learned from their processes'
    environment, and the card's active energy goes to the pod holding it."""
    with kubeedge_rig(fake_nvml, tmp_path) as args:
        with Agent(*args, "--interval", "200ms", env=fake_nvml.env()) as agent:

            def learned() -> dict:
                found = by_name(agent.metrics())
                pods = {
                    s[0]["pod"]: s[1] for s in found.get("kepler_bridge_pod_gpu_joules_total", [])
                }
                return (
                    found if len(found.get("gpu_pod_info", [])) == 3 and pods.get("infer-0") else {}
                )

            found = agent.wait_for(learned, what="three devices learned from the environment")
            started = found["kepler_bridge_last_sample_timestamp_seconds"][0][1]

            def a_second_later() -> dict:
                now = by_name(agent.metrics())
                stamp = now["kepler_bridge_last_sample_timestamp_seconds"][0][1]
                return now if stamp > started + 1.0 else {}

            later = agent.wait_for(a_second_later, timeout=30, what="samples a second later")
    holders = {
        labels["uuid"]: (labels["pod"], labels["container"], labels["source"])
        for labels, _ in found["gpu_pod_info"]
    }
    assert holders == {
        GPU0: ("train-0", "main", "environment"),
        "GPU-fa4e0000-0000-4000-8000-000000000001": ("infer-0", "server", "environment"),
        AMD: ("infer-0", "server", "environment"),
    }

    def infer_joules(snapshot: dict) -> float:
        return by("pod", snapshot["kepler_bridge_pod_gpu_joules_total"])["infer-0"]

    # Once learned, none of the card's active energy (200 W above idle) is left without an owner.
    assert no_owner(later) == no_owner(found)
    assert infer_joules(later) - infer_joules(found) > 50
