"""Container ids from cgroup paths (cgroup v1 and v2, every common runtime and driver).

Recognised path components (below a pod's cgroup the first, so a pod inside a
kind/docker node and a docker-in-docker sidecar's containers yield the pod's
container; elsewhere the innermost):

- docker:      ``/docker/<id>``, ``/system.slice/docker-<id>.scope``
- containerd:  ``cri-containerd-<id>.scope``, ``/kubepods/.../pod<uid>/<id>``,
               nerdctl's ``/<namespace>/<id>`` and ``nerdctl-<id>.scope``
- CRI-O:       ``crio-<id>.scope``, ``/kubepods/.../pod<uid>/crio-<id>``
- podman:      ``libpod-<id>.scope``, ``/libpod_parent/libpod-<id>``, and quadlet's
               ``--cgroups=split`` ``<unit>.service/libpod-payload-<id>``
- kubepods with the systemd (``kubepods-burstable-pod<uid>.slice``) or
  cgroupfs (``/kubepods/burstable/pod<uid>``) driver, and runc's systemd
  notation taken literally by shims that manage cgroupfs themselves
  (``kubepods-besteffort-pod<uid>.slice:cri-containerd:<id>``).

Runtime monitors (``crio-conmon-<id>``, ``libpod-conmon-<id>``) belong to no
container and yield ''.
"""

from __future__ import annotations

import os
import re

_ID = re.compile(
    r"^(?:[^:]*:)?"
    r"(?:(?:docker|cri-containerd|crio|cri-o|libpod-payload|libpod|containerd|nerdctl|podman)[-:])?"
    r"([0-9a-f]{64})(?:\.scope)?$"
)
# A pod's cgroup: cgroupfs's pod<uid>, systemd's kubepods[-<qos>]-pod<uid with _>.slice (a static
# pod's uid is 32 hex digits).
_POD = re.compile(r"^(?:kubepods(?:-[a-z]+)?-)?pod[0-9a-f][0-9a-f_-]{31,35}(?:\.slice)?$")
# Where the unified (v2) hierarchy is mounted: pure v2 hosts, then hybrid v1/v2 hosts.
_CGROUP2_MOUNTS = ("fs/cgroup", "fs/cgroup/unified")


def container_id_from_path(path: str) -> str:
    """The container id in one cgroup path, or '' for host processes: the pod's container where the
    path has a pod (what the kubelet lists, also for containers a docker-in-docker sidecar nests
    below it), else the innermost."""
    parts = path.split("/")
    pods = [at for at, part in enumerate(parts) if _POD.match(part)]
    for part in parts[pods[-1] + 1 :] if pods else reversed(parts):
        match = _ID.match(part)
        if match:
            return match.group(1)
    return ""


def container_id(cgroup_file_text: str) -> str:
    """The container id from the text of /proc/<pid>/cgroup (v1 lines and the v2 ``0::`` line)."""
    for line in cgroup_file_text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        found = container_id_from_path(path)
        if found:
            return found
    return ""


def read_container_id(procfs: str, pid: int) -> str | None:
    """Container id of a live process, '' for host processes, None when the process is gone or
    hidden (hidepid, an LSM)."""
    raw = read_raw_cgroup(procfs, pid)
    return None if raw is None else container_id(raw.decode(errors="replace"))


def read_raw_cgroup(procfs: str, pid: int) -> bytes | None:
    """The /proc/<pid>/cgroup text as it is; None when the process is gone or hidden."""
    # os.read: half the cost of a text file object (the procfs source reads it again and again).
    try:
        fd = os.open(f"{procfs}/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = [os.read(fd, 4096)]
            while len(chunks[-1]) == 4096:  # a long one (many v1 hierarchies) comes in pieces
                chunks.append(os.read(fd, 4096))
        finally:
            os.close(fd)
    except OSError:
        return None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class CgroupIdIndex:
    """Maps cgroup v2 ids (bpf_get_current_cgroup_id) to container ids for processes already gone.

    A v2 cgroup's id is the inode number of its directory, so one walk of the
    unified hierarchy indexes them; the walk repeats at most once per
    ``min_rescan`` seconds, when an unknown id shows up. Between walks it learns
    the container each living process showed (`learn`).
    """

    def __init__(self, sysfs: str = "/sys", min_rescan: float = 10.0) -> None:
        self.root = cgroup2_root(sysfs)
        self.min_rescan = min_rescan
        self._ids: dict[int, str] = {}
        self._scanned_at: float | None = None

    def container_id(self, cgroup_id: int, now: float) -> str:
        """Container id of the cgroup with this id, '' when unknown or not a container."""
        if cgroup_id in self._ids or not self.root:
            return self._ids.get(cgroup_id, "")
        if self._scanned_at is None or now - self._scanned_at >= self.min_rescan:
            self._scan()
            self._scanned_at = now
        return self._ids.get(cgroup_id, "")

    def learn(self, cgroup_id: int, container_id: str) -> None:
        """The container a living process of this cgroup showed in /proc: its siblings that end
        before the next walk are booked to it too."""
        self._ids[cgroup_id] = container_id

    def _scan(self) -> None:
        # Every cgroup is indexed, host ones as '': an id left out would be unknown and bring the
        # walk back.
        ids: dict[int, str] = {}
        try:
            ids[os.stat(self.root).st_ino] = ""
        except OSError:
            pass
        pending = [(self.root, "", False)]
        while pending:
            directory, inherited, in_pod = pending.pop()
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if in_pod and inherited:  # below a pod the first container is the pod's
                    found = inherited
                else:
                    found = container_id_from_path(entry.name) or inherited
                ids[entry.inode()] = found
                pending.append((entry.path, found, in_pod or bool(_POD.match(entry.name))))
        self._ids = ids


def cgroup2_root(sysfs: str) -> str:
    """The mounted cgroup v2 hierarchy under sysfs ('' when there is none)."""
    for relative in _CGROUP2_MOUNTS:
        path = os.path.join(sysfs, relative)
        if os.path.isfile(os.path.join(path, "cgroup.controllers")):
            return path
    return ""
