"""A node as on KubeEdge: pods from a MetaServer, no pod-resources socket, real processes in
container cgroups naming their devices in their environment, an AMD card drawing 250 W."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from cpu_helpers import container_cgroup
from fakenvml import FakeNvml
from fixtures.sysfs import FakeSysfs
from kubefakes import FakeKube, pod, pod_list
from scaffold import require, wait_for
from test_energy_e2e import drawing, write_microjoules

TRAIN, INFER = "7" * 64, "8" * 64
AMD = "AMD-b2c8a7e2f3d41c8f"
GPU0 = "GPU-fa4e0000-0000-4000-8000-000000000000"


def child(started: list[subprocess.Popen], **variables: str) -> int:
    """A real process whose environment carries `variables`."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={"PATH": os.environ.get("PATH", "/usr/bin"), **variables},
    )
    started.append(process)
    # Popen returns once exec has begun; the new environment is readable a moment later.
    wait_for(lambda: Path(f"/proc/{process.pid}/environ").read_bytes(), 5, "the child's exec")
    return process.pid


@contextmanager
def kubeedge_rig(fake_nvml: FakeNvml, tmp_path: Path) -> Iterator[list[str]]:
    """Two containers: train-0 given GPU 0 by uuid, infer-0 GPU 1 by index and the AMD card by
    its ROCm uuid. Gives the agent's settings for that node."""
    require(os.geteuid() == 0, "not root: moving processes into container cgroups needs root")
    sysfs = FakeSysfs(tmp_path / "sys")
    card = sysfs.amd_mi210(0, "0000:c3:00.0")
    (energy_file,) = (card / "device" / "hwmon").glob("hwmon*/energy1_input")
    children: list[subprocess.Popen] = []
    pods = pod_list(
        pod("ml", "train-0", ("main", f"cri-o://{TRAIN}"), node="test-node"),
        pod("ml", "infer-0", ("server", f"cri-o://{INFER}"), node="test-node"),
    )
    with (
        container_cgroup("kubeedge-rig", TRAIN) as train,
        container_cgroup("kubeedge-rig", INFER) as infer,
        FakeKube(pods) as metaserver,
        drawing(write_microjoules(energy_file), int(energy_file.read_text()) / 1e6, watts=250.0),
    ):
        (train / "cgroup.procs").write_text(str(child(children, NVIDIA_VISIBLE_DEVICES=GPU0)))
        infer_pid = child(
            children, NVIDIA_VISIBLE_DEVICES="1", ROCR_VISIBLE_DEVICES="GPU-b2c8a7e2f3d41c8f"
        )
        (infer / "cgroup.procs").write_text(str(infer_pid))
        try:
            yield [
                *("--sources", "nvml,amdgpu,procfs", "--nvml-library", str(fake_nvml.library)),
                *("--sysfs", str(sysfs.root), "--gpu-idle-watts", "50"),
                *("--kube-source", "metaserver", "--metaserver-url", metaserver.url),
                *("--pod-resources-socket", str(tmp_path / "absent.sock")),
            ]
        finally:
            for process in children:
                process.kill()
                process.wait()


def no_owner(snapshot: dict) -> float:
    """Joules of the AMD card's active energy that no container holds."""
    return sum(
        value
        for labels, value in snapshot.get("kepler_bridge_node_gpu_unattributed_joules_total", [])
        if labels["uuid"] == AMD and labels["reason"] == "no_owner"
    )
