"""Container ids from /proc/<pid>/cgroup: one fixture per runtime, driver and cgroup version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kepler_bridge.sources.cgroup import (
    CgroupIdIndex,
    container_id,
    container_id_from_path,
    read_container_id,
)
from kepler_bridge.sources.ebpf.source import EbpfSource
from scaffold import make_config, require

ID = "3f0a8e6b1c2d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7"
POD = "0b6c3a1e-8f7d-4e2a-9c5b-1d2e3f4a5b6c"
POD_SYSTEMD = POD.replace("-", "_")

V1_HOST = """12:cpuset:/
11:memory:/user.slice/user-0.slice/session-1.scope
4:cpu,cpuacct:/user.slice
1:name=systemd:/user.slice/user-0.slice/session-1.scope
0::/user.slice/user-0.slice/session-1.scope
"""

FIXTURES = {
    # docker
    "docker cgroupfs v1": (
        f"12:cpu,cpuacct:/docker/{ID}\n11:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n"
    ),
    "docker systemd v1": (
        f"4:cpu,cpuacct:/system.slice/docker-{ID}.scope\n"
        f"1:name=systemd:/system.slice/docker-{ID}.scope\n"
    ),
    "docker systemd v2": f"0::/system.slice/docker-{ID}.scope\n",
    # containerd / cri-containerd in Kubernetes
    "kubepods systemd containerd v2": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_SYSTEMD}.slice/"
        f"cri-containerd-{ID}.scope\n"
    ),
    "kubepods systemd containerd guaranteed v2": (
        f"0::/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice/cri-containerd-{ID}.scope\n"
    ),
    # runc's systemd notation taken literally by shims that manage cgroupfs (runwasi, kata).
    "kubepods systemd notation as a path v2": (
        f"0::/kubepods-besteffort-pod{POD_SYSTEMD}.slice:cri-containerd:{ID}\n"
    ),
    "kubepods systemd notation as a path, crio v2": (
        f"0::/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice:crio:{ID}\n"
    ),
    "kubepods cgroupfs containerd v1": (
        f"11:memory:/kubepods/besteffort/pod{POD}/{ID}\n"
        f"4:cpu,cpuacct:/kubepods/besteffort/pod{POD}/{ID}\n"
    ),
    "kubepods cgroupfs containerd v2": f"0::/kubepods/burstable/pod{POD}/{ID}\n",
    "kubepods cgroupfs guaranteed v2": f"0::/kubepods/pod{POD}/{ID}\n",
    "containerd seen from a pod's cgroup namespace v2": (
        f"0::/../../kubepods-besteffort-pod{POD_SYSTEMD}.slice/cri-containerd-{ID}.scope\n"
    ),
    "nerdctl systemd v2": f"0::/system.slice/nerdctl-{ID}.scope\n",
    "nerdctl cgroupfs v2": f"0::/default/{ID}\n",
    # CRI-O
    "crio systemd v2": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_SYSTEMD}.slice/"
        f"crio-{ID}.scope\n"
    ),
    "crio systemd v1": (
        f"9:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{POD_SYSTEMD}.slice/crio-{ID}.scope\n"
    ),
    "crio cgroupfs v1": f"4:cpu,cpuacct:/kubepods/burstable/pod{POD}/crio-{ID}\n",
    "crio container sub-cgroup v2": (
        f"0::/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice/crio-{ID}.scope/container\n"
    ),
    # podman
    "podman rootful systemd v2": f"0::/machine.slice/libpod-{ID}.scope/container\n",
    "podman rootless v2": (
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n"
    ),
    "podman cgroupfs v1": f"4:cpu,cpuacct:/libpod_parent/libpod-{ID}\n",
    "podman quadlet (--cgroups=split) v2": f"0::/system.slice/nginx.service/libpod-payload-{ID}\n",
    "podman quadlet rootless v2": (
        f"0::/user.slice/user-1000.slice/user@1000.service/app.slice/web.service/"
        f"libpod-payload-{ID}\n"
    ),
    # nested: a pod inside a kind node, which is itself a docker container
    "kind node v1": f"4:cpu,cpuacct:/docker/{'a' * 64}/kubepods/besteffort/pod{POD}/{ID}\n",
    # hybrid host: v2 line at the root, the id only on v1 lines
    "hybrid v1+v2": f"4:cpu,cpuacct:/docker/{ID}\n0::/\n",
}

NOT_CONTAINERS = {
    "host v1+v2": V1_HOST,
    "inside a private cgroup namespace v2": "0::/\n",
    "kubelet v2": "0::/kubepods.slice\n",
    "pod slice without container v2": f"0::/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice\n",
    "crio conmon v2": (
        f"0::/kubepods.slice/kubepods-pod{POD_SYSTEMD}.slice/crio-conmon-{ID}.scope\n"
    ),
    "podman conmon v2": f"0::/machine.slice/libpod-conmon-{ID}.scope\n",
    "short hex is not an id": "0::/docker/3f0a8e6b1c2d\n",
    "empty": "",
}


@pytest.mark.parametrize("text", FIXTURES.values(), ids=FIXTURES.keys())
def test_container_id_recognised(text: str) -> None:
    assert container_id(text) == ID


@pytest.mark.parametrize("text", NOT_CONTAINERS.values(), ids=NOT_CONTAINERS.keys())
def test_host_processes_have_no_container_id(text: str) -> None:
    assert container_id(text) == ""


def test_innermost_container_wins() -> None:
    outer, inner = "a" * 64, "b" * 64
    assert container_id_from_path(f"/docker/{outer}/docker/{inner}") == inner


@pytest.mark.parametrize(
    "path",
    [
        f"/kubepods/burstable/pod{POD}/{ID}/docker/{'b' * 64}",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_SYSTEMD}.slice/"
        f"cri-containerd-{ID}.scope/docker/{'b' * 64}",
    ],
    ids=["cgroupfs v1", "systemd v2"],
)
def test_a_docker_in_docker_sidecars_containers_are_the_pods_container(path: str) -> None:
    """dockerd in a pod's container (a CI runner's dind sidecar) nests its containers below it:
    the kubelet lists the pod's container, which the work belongs to, not the inner ones."""
    assert container_id_from_path(path) == ID


def test_read_container_id_from_a_procfs_tree(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(FIXTURES["crio systemd v2"])
    assert read_container_id(str(tmp_path), 42) == ID
    assert read_container_id(str(tmp_path), 43) is None


def test_cgroup_id_index_maps_directory_inodes(tmp_path: Path) -> None:
    unified = tmp_path / "fs" / "cgroup"
    scope = (
        unified
        / "kubepods.slice"
        / f"kubepods-pod{POD_SYSTEMD}.slice"
        / f"cri-containerd-{ID}.scope"
    )
    (scope / "init").mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu memory\n")
    index = CgroupIdIndex(str(tmp_path), min_rescan=10)
    assert index.container_id(os.stat(scope).st_ino, now=0) == ID
    assert index.container_id(os.stat(scope / "init").st_ino, now=0) == ID
    assert index.container_id(os.stat(unified / "kubepods.slice").st_ino, now=0) == ""
    # A cgroup created after the walk is found once min_rescan has passed.
    later = unified / f"docker-{'c' * 64}.scope"
    later.mkdir()
    assert index.container_id(os.stat(later).st_ino, now=5) == ""
    assert index.container_id(os.stat(later).st_ino, now=10) == "c" * 64


def test_a_process_ended_in_a_container_newer_than_the_walk_is_its_siblings(
    tmp_path: Path,
) -> None:
    """eBPF reads a living process's container from /proc; one of its cgroup that starts and ends
    before the next walk (a compiler, a probe) is booked to that container, not to the host."""
    unified = tmp_path / "sys" / "fs" / "cgroup"
    unified.mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu memory\n")
    source = EbpfSource(make_config(sysfs=str(tmp_path / "sys"), procfs=str(tmp_path / "proc")))
    assert source.cgroups.container_id(os.stat(unified).st_ino, now=0) == ""  # walked at 0
    scope = unified / f"cri-containerd-{ID}.scope"
    scope.mkdir()  # a container started after the walk
    (tmp_path / "proc" / "42").mkdir(parents=True)
    (tmp_path / "proc" / "42" / "cgroup").write_text(f"0::/cri-containerd-{ID}.scope\n")
    assert source._container(42, os.stat(scope).st_ino, now=1) == ID
    assert source.cgroups.container_id(os.stat(scope).st_ino, now=2) == ID


def test_the_cgroup_walk_books_a_dind_sidecars_containers_to_the_pods(tmp_path: Path) -> None:
    unified = tmp_path / "fs" / "cgroup"
    pod_container = unified / "kubepods" / f"pod{POD}" / ID
    inner = pod_container / "docker" / ("b" * 64)
    inner.mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu memory\n")
    index = CgroupIdIndex(str(tmp_path))
    assert index.container_id(os.stat(inner).st_ino, now=0) == ID
    assert index.container_id(os.stat(pod_container).st_ino, now=0) == ID


def test_host_cgroups_are_indexed_so_they_do_not_bring_the_walk_back(tmp_path: Path) -> None:
    unified = tmp_path / "fs" / "cgroup"
    host = unified / "system.slice" / "cron.service"
    host.mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu memory\n")
    index = CgroupIdIndex(str(tmp_path), min_rescan=10)
    assert index.container_id(os.stat(host).st_ino, now=0) == ""
    assert (
        index.container_id(os.stat(unified).st_ino, now=20) == ""
    )  # known (the root): no new walk at 20
    later = unified / f"docker-{'d' * 64}.scope"
    later.mkdir()
    # Had the host lookups walked again at 20, the next walk would wait until 30.
    assert index.container_id(os.stat(later).st_ino, now=25) == "d" * 64


def test_cgroup_id_index_without_cgroup2(tmp_path: Path) -> None:
    assert CgroupIdIndex(str(tmp_path)).container_id(12345, now=0) == ""


def _hierarchies() -> list[Path]:
    """Writable cgroup hierarchies here: v1 cpu controller and the v2 unified tree."""
    found = []
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cgroup.procs").exists() and not (v1 / "cgroup.controllers").exists():
        found.append(v1)
    found += [
        root
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
        if (root / "cgroup.controllers").exists()
    ][:1]
    return found


def test_real_process_in_a_container_cgroup() -> None:
    """A child moved into a docker-named cgroup of each hierarchy here reports that container id."""
    require(os.geteuid() == 0, "not root: creating cgroups and moving processes needs root")
    hierarchies = _hierarchies()
    assert hierarchies, "no cgroup v1 cpu or v2 hierarchy mounted under /sys/fs/cgroup"
    for root in hierarchies:
        cgroup = root / "kepler-bridge-test" / f"docker-{ID}.scope"
        cgroup.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            (cgroup / "cgroup.procs").write_text(str(child.pid))
            assert read_container_id("/proc", child.pid) == ID, root
        finally:
            child.kill()
            child.wait()
            cgroup.rmdir()
            cgroup.parent.rmdir()
