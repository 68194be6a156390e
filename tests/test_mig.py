"""MIG: the fake's MIG devices through the real pynvml, the agent's MIG series, ownership of
processes in MIG devices assigned by pod-resources, and the energy split over GPU instances."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from agent import Agent
from fakenvml import FakeNvml, mig_uuid
from kepler_bridge.kube.view import Assignment, KubeView, device_owners
from kepler_bridge.model import GpuProcess, GpuReading, MigInstance, PodRef
from kepler_bridge.sampling.gpu_energy import mig_shares
from kepler_bridge.sampling.sampler import join_owners
from kubefakes import FakePodResources, list_response
from scaffold import by_name

GIB = 1024**3
MIB = 1024**2
TRAIN = PodRef("ml", "train-0", "main")
INFER = PodRef("ml", "infer-0", "server")


def two_instances(fake: FakeNvml) -> None:
    """GPU 0 in MIG mode: a 3g.40gb instance with pid 999001, a 1g.10gb one with pid 999002."""
    fake.processes(
        0,
        [
            {"pid": 999001, "used_memory": 3 * GIB, "gpu_instance": 1, "compute_instance": 0},
            {"pid": 999002, "used_memory": GIB, "gpu_instance": 2, "compute_instance": 0},
        ],
    )
    fake.mig(0, [mig_device(1, "3g.40gb", 3 * GIB), mig_device(2, "1g.10gb", GIB)])


def mig_device(gpu_instance: int, profile: str, used: int) -> dict:
    return {
        "gpu_instance": gpu_instance,
        "compute_instance": 0,
        "profile": profile,
        "memory_used": used,
    }


def test_mig_devices_through_pynvml_and_a_destroyed_one_answers_not_found(
    fake_nvml: FakeNvml,
) -> None:
    two_instances(fake_nvml)
    script = textwrap.dedent(
        """
        import ctypes, json, sys
        import pynvml
        pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out = {"mode": pynvml.nvmlDeviceGetMigMode(h), "devices": []}
        try:
            pynvml.nvmlDeviceGetUtilizationRates(h)
        except pynvml.NVMLError as err:
            out["utilization"] = err.value
        handles = []
        for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                handles.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i))
            except pynvml.NVMLError_NotFound:
                pass
        for m in handles:
            gi = pynvml.nvmlDeviceGetGpuInstanceId(m)
            info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(h, gi))
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
            out["devices"].append([
                pynvml.nvmlDeviceGetUUID(m), gi, pynvml.nvmlDeviceGetComputeInstanceId(m),
                pynvml.nvmlDeviceGetMemoryInfo(m).total, info.profileId,
                [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(m)],
                pynvml.nvmlDeviceGetUUID(parent),
            ])
        profile = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
        out["profile"] = [profile.id, profile.sliceCount, profile.name]
        sys.stdout.write(json.dumps(out) + "\\n")
        sys.stdout.flush()
        sys.stdin.readline()  # the test destroys GPU instance 1 meanwhile
        try:
            pynvml.nvmlDeviceGetUUID(handles[0])
        except pynvml.NVMLError as err:
            print(err.value)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(fake_nvml.library)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**fake_nvml.env(), "PATH": "/usr/bin:/bin"},
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        first = json.loads(child.stdout.readline())
        fake_nvml.mig(0, [fake_nvml.migs[0][2][1]])
        child.stdin.write("\n")
        child.stdin.flush()
        stale = child.stdout.readline().strip()
    parent = fake_nvml.gpus[0]["uuid"]
    assert first["mode"] == [1, 1] and first["utilization"] == 3  # NOT_SUPPORTED
    assert first["devices"] == [
        [mig_uuid(0, 1, 0), 1, 0, 40192 * MIB, 9, [999001], parent],
        [mig_uuid(0, 2, 0), 2, 0, 9856 * MIB, 19, [999002], parent],
    ]
    assert first["profile"] == [19, 1, "MIG 1g.10gb"]
    assert stale == "6"  # NOT_FOUND


def test_mig_processes_come_from_the_mig_devices_where_the_parent_list_is_refused(
    fake_nvml: FakeNvml,
) -> None:
    """NVML lists a MIG parent's processes to a privileged caller only (NO_PERMISSION to
    others): the MIG devices' own lists give them then, with their memory, in their instances."""
    two_instances(fake_nvml)
    fake_nvml.gpu(0, errors={"compute_processes": pynvml.NVML_ERROR_NO_PERMISSION})
    script = textwrap.dedent(
        """
        import json, sys
        import pynvml
        from kepler_bridge import config
        from kepler_bridge.sampling.gpu_energy import mig_shares
        from kepler_bridge.sources.nvml.source import NvmlSource

        source = NvmlSource(config.load({"nvml_library": sys.argv[1]}, {}))
        source.start()
        try:
            pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
        except pynvml.NVMLError as err:
            refused = err.value
        found = []
        for _ in range(2):
            gpu = source.read().gpus[0]
            found.append([
                gpu.up,
                [[proc.pid, proc.memory_used_bytes] for proc in gpu.processes],
                [[mig.gpu_instance, list(mig.pids)] for mig in gpu.mig_instances],
                mig_shares(gpu),
            ])
        source.stop()
        print(json.dumps([refused, found]))
        """
    )
    (refused, found), stderr = fake_nvml.printed(script)
    assert refused == pynvml.NVML_ERROR_NO_PERMISSION
    expected = [
        True,
        [[999001, 3 * GIB], [999002, GIB]],
        [[1, [999001]], [2, [999002]]],
        [0.75, 0.25],  # by the instances' compute slices, 3 and 1
    ]
    assert found == [expected, expected], stderr


def assigned() -> bytes:
    return list_response(
        [
            ("ml", "train-0", [("main", [("nvidia.com/mig-3g.40gb", [mig_uuid(0, 1, 0)])])]),
            ("ml", "infer-0", [("server", [("nvidia.com/mig-1g.10gb", [mig_uuid(0, 2, 0)])])]),
        ]
    )


@pytest.mark.e2e
def test_agent_reports_mig_instances_their_pods_and_a_destroyed_one_goes(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    two_instances(fake_nvml)
    socket = tmp_path / "kubelet.sock"
    with (
        FakePodResources(socket, assigned()),
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
            "--process-metrics",
            "all",
            env=fake_nvml.env(),
        ) as agent,
    ):
        found = agent.wait_for(
            lambda: (lambda f: f if "gpu_mig_pod_info" in f else {})(by_name(agent.metrics())),
            what="gpu_mig_pod_info",
        )
        collect = agent.get("/v1/collect").json()
        fake_nvml.mig(0, [fake_nvml.migs[0][2][1]])  # GPU instance 1 destroyed
        after = agent.wait_for(
            lambda: (lambda f: f if len(f["gpu_mig_info"]) == 1 else {})(by_name(agent.metrics())),
            what="the destroyed MIG device gone",
        )
    info = {
        (labels["gpu"], labels["gpu_instance"], labels["compute_instance"]): (
            labels["profile"],
            labels["mig_uuid"],
        )
        for labels, _ in found["gpu_mig_info"]
    }
    assert info == {
        ("0", "1", "0"): ("3g.40gb", mig_uuid(0, 1, 0)),
        ("0", "2", "0"): ("1g.10gb", mig_uuid(0, 2, 0)),
    }
    memory = {
        (labels["gpu_instance"], labels["profile"]): value
        for labels, value in found["gpu_mig_memory_total_bytes"]
    }
    assert memory == {("1", "3g.40gb"): 40192 * MIB, ("2", "1g.10gb"): 9856 * MIB}
    used = {labels["gpu_instance"]: value for labels, value in found["gpu_mig_memory_used_bytes"]}
    assert used == {"1": 3 * GIB, "2": GIB}
    pods = {labels["gpu_instance"]: labels["pod"] for labels, _ in found["gpu_mig_pod_info"]}
    assert pods == {"1": "train-0", "2": "infer-0"}
    # The MIG parent has no utilization (absent, not 0); GPU 1, not in MIG mode, has.
    assert {labels["gpu"] for labels, _ in found["gpu_utilization_ratio"]} == {"1"}
    assert {labels["gpu"] for labels, _ in found["gpu_memory_used_bytes"]} == {"0", "1"}
    # Processes in MIG devices stay the parent's rows; each gets its MIG device's one holder.
    owners = {
        labels["pid"]: (labels["gpu"], labels["pod"])
        for labels, _ in found["gpu_process_memory_used_bytes"]
        if labels["gpu"] == "0"
    }
    assert owners == {"999001": ("0", "train-0"), "999002": ("0", "infer-0")}
    assert "gpu_pod_info" not in found  # two pods share the card
    # /v1/collect: one entry per physical card, the parent's memory.
    devices = collect["test-node"]["devices"]
    assert len(devices) == 2 and devices[0]["usedMemory"] == fake_nvml.gpus[0]["memory_used"]
    assert {labels["gpu_instance"] for labels, _ in after["gpu_mig_info"]} == {"2"}
    assert {labels["gpu_instance"] for labels, _ in after["gpu_mig_memory_used_bytes"]} == {"2"}


def mig_gpu(processes: tuple[GpuProcess, ...], *instances: MigInstance) -> GpuReading:
    return GpuReading(
        index=0,
        uuid="GPU-0",
        vendor="nvidia",
        model="A100",
        processes=processes,
        mig_uuids=tuple(i.uuid for i in instances),
        mig_instances=instances,
    )


def test_energy_goes_to_busy_gpu_instances_by_slices_then_to_processes_by_memory() -> None:
    processes = (
        GpuProcess(pid=1, memory_used_bytes=3 * GIB),
        GpuProcess(pid=2, memory_used_bytes=GIB),
        GpuProcess(pid=3, memory_used_bytes=GIB),
        GpuProcess(pid=4),  # listed by no MIG device: nothing
    )
    gpu = mig_gpu(
        processes,
        MigInstance(1, 0, "MIG-a", "3g.40gb", 3, pids=(1, 2)),
        MigInstance(2, 0, "MIG-b", "1g.10gb", 1, pids=(3,)),
        MigInstance(3, 0, "MIG-c", "2g.20gb", 2),  # idle: no share
    )
    shares = mig_shares(gpu)
    assert shares == pytest.approx([0.75 * 0.75, 0.75 * 0.25, 0.25, 0.0])
    unknown = mig_gpu(
        (GpuProcess(pid=1), GpuProcess(pid=3)),
        MigInstance(1, 0, "MIG-a", pids=(1,)),
        MigInstance(2, 0, "MIG-b", pids=(3,)),
    )
    assert mig_shares(unknown) == pytest.approx([0.5, 0.5])  # slices unknown: equal
    assert mig_shares(mig_gpu(processes, MigInstance(1, 0, "MIG-a", slices=3))) is None


def test_processes_get_the_one_holder_of_their_mig_device() -> None:
    gpu = mig_gpu(
        (
            GpuProcess(pid=1),  # another pid namespace: no comm, no container
            GpuProcess(pid=2),
            GpuProcess(pid=3, comm="python3"),  # a host process: nobody's
        ),
        MigInstance(1, 0, "MIG-a", pids=(1, 3)),
        MigInstance(2, 0, "MIG-b", pids=(2,)),
    )
    view = KubeView(
        devices=device_owners(
            [
                Assignment("MIG-a", "nvidia.com/mig-3g.40gb", TRAIN),
                Assignment("MIG-b", "nvidia.com/mig-1g.10gb", INFER),
            ]
        )
    )
    joined = join_owners(gpu, view)
    assert [proc.owner for proc in joined.processes] == [TRAIN, INFER, PodRef()]
    assert [i.holders[0].owner for i in joined.mig_instances] == [TRAIN, INFER]
    assert joined.holder is None  # the card is shared


def gpm_instances(fake: FakeNvml) -> None:
    """two_instances with GPM: GPU instance 1 at SM 50 %, GPU instance 2 at SM 100 %."""
    two_instances(fake)
    sm, occupancy = pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    tensor, dram = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    first, second = fake.migs[0][2]
    first["gpm_metrics"] = {sm: 50.0, occupancy: 20.0, tensor: 30.0, dram: 40.0}
    second["gpm_metrics"] = {sm: 100.0}
    fake.gpu(0, gpm_supported=True, gpm_metrics={sm: 75.0})
    fake.mig(0, [first, second])


def test_gpm_mig_samples_through_pynvml_per_gpu_instance(fake_nvml: FakeNvml) -> None:
    gpm_instances(fake_nvml)
    script = textwrap.dedent(
        """
        import ctypes, json, sys, time
        import pynvml
        pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        def sm(first, second):
            request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 1
            request.sample1, request.sample2 = first, second
            request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
            try:
                pynvml.nvmlGpmMetricsGet(request)
            except pynvml.NVMLError as err:
                return err.value
            return round(request.metrics[0].value, 3)
        a, b, c = (pynvml.nvmlGpmSampleAlloc() for _ in range(3))
        pynvml.nvmlGpmMigSampleGet(h, 1, a)
        pynvml.nvmlGpmMigSampleGet(h, 2, c)
        time.sleep(0.05)
        pynvml.nvmlGpmMigSampleGet(h, 1, b)
        out = {"instance": sm(a, b), "mixed": sm(c, b)}
        for gi in (5, 16):
            try:
                pynvml.nvmlGpmMigSampleGet(h, gi, a)
            except pynvml.NVMLError as err:
                out[str(gi)] = err.value
        try:
            pynvml.nvmlGpmMigSampleGet(pynvml.nvmlDeviceGetHandleByIndex(1), 0, a)
        except pynvml.NVMLError as err:
            out["not_mig"] = err.value
        print(json.dumps(out))
        """
    )
    found, _ = fake_nvml.printed(script)
    # Its own rate; samples of two GPU instances do not pair; no such instance: NOT_FOUND (6);
    # a GPU with GPM but not in MIG mode: NOT_SUPPORTED (3).
    assert found == {
        "instance": 50.0,
        "mixed": pynvml.NVML_ERROR_INVALID_ARGUMENT,
        "5": 6,
        "16": 6,
        "not_mig": 3,
    }


def per_instance(found: dict, name: str) -> dict[str, float]:
    return {labels["gpu_instance"] + "/" + labels["profile"]: v for labels, v in found[name]}


@pytest.mark.e2e
def test_agent_reports_gpm_per_gpu_instance_and_frees_a_destroyed_ones_samples(
    fake_nvml: FakeNvml,
) -> None:
    gpm_instances(fake_nvml)
    fake_nvml.gpu(1, gpm_supported=True)
    args = ("--sources", "nvml", "--nvml-library", str(fake_nvml.library), "--interval", "200ms")
    with Agent(*args, "--kube-source", "off", env=fake_nvml.env()) as agent:
        found = agent.wait_for(
            lambda: (lambda f: f if len(f.get("gpu_mig_sm_active_ratio", ())) == 2 else {})(
                by_name(agent.metrics())
            ),
            what="GPM per GPU instance",
        )
        fake_nvml.mig(0, [fake_nvml.migs[0][2][1]])  # GPU instance 1 destroyed
        after = agent.wait_for(
            lambda: (lambda f: f if len(f.get("gpu_mig_sm_active_ratio", ())) == 1 else {})(
                by_name(agent.metrics())
            ),
            what="the destroyed GPU instance's series gone",
        )
        assert fake_nvml.calls()["nvmlGpmSampleFree"] == 2  # its two samples, freed at once
    approx = pytest.approx
    assert per_instance(found, "gpu_mig_sm_active_ratio") == {
        "1/3g.40gb": approx(0.5),
        "2/1g.10gb": approx(1.0),
    }
    assert per_instance(found, "gpu_mig_sm_occupancy_ratio") == {
        "1/3g.40gb": approx(0.2),
        "2/1g.10gb": 0.0,
    }
    assert per_instance(found, "gpu_mig_tensor_active_ratio")["1/3g.40gb"] == approx(0.3)
    assert per_instance(found, "gpu_mig_dram_active_ratio")["1/3g.40gb"] == approx(0.4)
    assert len(found["gpu_mig_graphics_active_ratio"]) == 2
    assert {labels["gpu"] for labels, _ in found["gpu_sm_active_ratio"]} == {"0", "1"}
    assert {labels["gpu"] for labels, _ in found["gpu_mig_sm_active_ratio"]} == {"0"}
    assert set(per_instance(after, "gpu_mig_sm_active_ratio")) == {"2/1g.10gb"}
    assert {labels["gpu_instance"] for labels, _ in after["gpu_mig_info"]} == {"2"}
    calls = fake_nvml.calls()
    # Two per GPU and two per GPU instance, every one freed (on destroy and on stop).
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] == 8


def test_energy_goes_to_gpu_instances_by_sms_in_use_where_gpm_reports_them() -> None:
    processes = (GpuProcess(pid=1), GpuProcess(pid=2))
    half_3g = MigInstance(1, 0, "MIG-a", "3g.40gb", 3, pids=(1,), sm_active=0.5)
    full_1g = MigInstance(2, 0, "MIG-b", "1g.10gb", 1, pids=(2,), sm_active=1.0)
    assert mig_shares(mig_gpu(processes, half_3g, full_1g)) == pytest.approx([0.6, 0.4])
    # One without activity, or none active: by slices, as without GPM.
    unknown = dataclasses.replace(full_1g, sm_active=None)
    assert mig_shares(mig_gpu(processes, half_3g, unknown)) == pytest.approx([0.75, 0.25])
    idle = (dataclasses.replace(half_3g, sm_active=0.0), dataclasses.replace(full_1g, sm_active=0))
    assert mig_shares(mig_gpu(processes, *idle)) == pytest.approx([0.75, 0.25])


def test_mig_mode_is_asked_with_the_slow_counters_while_off_and_each_sample_while_on(
    fake_nvml: FakeNvml,
) -> None:
    """MIG mode changes only with a GPU reset: a GPU not in it is asked again with the slow
    counters (--nvml-counter-interval), so one put in MIG mode shows its instances by then; one in
    it is asked each sample, so one taken out of it shows none at the next."""
    fake_nvml.mig(0, [mig_device(1, "1g.10gb", GIB)])
    on = fake_nvml.render()
    fake_nvml.mig(0, [], mode=False)
    script = textwrap.dedent(
        """
        import ctypes, json, os, sys, time
        from kepler_bridge import config
        from kepler_bridge.sources.nvml.source import NvmlSource

        settings = {"nvml_library": sys.argv[1], "interval": "1s", "nvml_counter_interval": "2s"}
        source = NvmlSource(config.load(settings, {}))
        source.start()
        library = ctypes.CDLL(sys.argv[1])
        library.fakenvml_call_count.restype = ctypes.c_ulonglong
        path = os.environ["FAKE_NVML_CONFIG"]
        off = open(path).read()

        def configured(text):
            with open(path + ".new", "w") as new:
                new.write(text)
            os.replace(path + ".new", path)

        found = []

        def read():
            gpus = source.read().gpus
            asked = library.fakenvml_call_count(b"nvmlDeviceGetMigMode")
            found.append([[len(gpu.mig_instances) for gpu in gpus], asked])

        read()
        read()
        configured(sys.argv[2])
        read()
        time.sleep(1.6)  # the slow counters' period: 2 s less half an interval
        read()
        read()
        configured(off)
        read()
        source.stop()
        print(json.dumps(found))
        """
    )
    found, stderr = fake_nvml.printed(script, on)
    assert found == [
        [[0, 0], 2],  # both asked with the first slow counters
        [[0, 0], 2],
        [[0, 0], 2],  # in MIG mode now, not asked yet
        [[1, 0], 4],  # both asked with the slow counters
        [[1, 0], 5],  # GPU 0, in MIG mode, asked each sample
        [[0, 0], 6],  # and out of it at once
    ], stderr
