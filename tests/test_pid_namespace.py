"""The agent outside the pid namespace its --procfs shows (a pod without hostPID, the host's /proc
mounted): the kernel's task iterator then walks only the agent's own namespace, and the NVIDIA
driver lists only that namespace's GPU processes. `doctor` and the log say so, and procfs takes
eBPF's place (manifests/README.md, "Host PID namespace").

`tests/test_image.py` runs the image that way and checks that procfs still names host processes by
their host pids.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from agent import KEPLER_BRIDGE
from fakenvml import FakeNvml
from scaffold import require

pytestmark = pytest.mark.e2e
# A new pid namespace that still sees this machine's /proc, as a pod without hostPID sees the
# host's /proc mounted at --procfs.
OWN_PID_NAMESPACE = ("unshare", "--pid", "--fork")


@pytest.fixture(autouse=True)
def unshare() -> None:
    require(
        os.geteuid() == 0 and shutil.which("unshare") is not None,
        "needs root and unshare(1): the tests run doctor in a pid namespace of its own",
    )


def _doctor(*prefix: str, args: tuple[str, ...], env: dict[str, str]) -> dict[str, str]:
    """source -> its `doctor` line."""
    doctor = subprocess.run(
        [*prefix, KEPLER_BRIDGE, "doctor", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert doctor.returncode == 0, doctor.stderr
    return {line.split()[1]: line for line in doctor.stdout.splitlines() if len(line.split()) > 1}


def test_doctor_says_nvml_cannot_see_other_pods_without_host_pid(fake_nvml: FakeNvml) -> None:
    args = ("--sources", "nvml", "--nvml-library", str(fake_nvml.library))
    in_host = _doctor(args=args, env=fake_nvml.env())["nvml"]
    assert in_host.startswith("ok") and "hostPID" not in in_host, in_host
    alone = _doctor(*OWN_PID_NAMESPACE, args=args, env=fake_nvml.env())["nvml"]
    assert alone.startswith("ok"), alone
    assert "runs in a pid namespace of its own (pid 1, " in alone, alone
    assert "only the GPU processes of that namespace" in alone, alone
    assert "run the pod with hostPID: true" in alone, alone


def test_ebpf_is_refused_and_procfs_reads_the_hosts_processes_without_host_pid() -> None:
    lines = _doctor(*OWN_PID_NAMESPACE, args=("--sources", "ebpf,procfs"), env={})
    assert lines["ebpf"].startswith("no  ebpf       the agent runs in pid namespace pid:["), lines
    assert "task iterator sees only the processes of that namespace" in lines["ebpf"]
    assert "run the pod with hostPID: true" in lines["ebpf"]
    # This machine's /proc shows more processes than the new namespace holds (doctor alone).
    procfs = lines["procfs"].split()
    assert procfs[0] == "ok" and int(procfs[2]) > 1, lines["procfs"]
