"""Process names and cgroup paths are bytes: no name a process gives itself may take a source
down."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaffold
from agent import Agent
from fakenvml import FakeNvml
from kepler_bridge.exposition import prometheus
from kepler_bridge.printable import printable
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore

NON_UTF8 = b"\xff\xfegpu\x80job"
# Renames itself with the bytes given in hex (as prctl(PR_SET_NAME) would), says so, then waits.
RENAMED = """
import sys
with open("/proc/self/comm", "wb") as comm:
    comm.write(bytes.fromhex(sys.argv[1]))
print("renamed", flush=True)
sys.stdin.read()
"""


def samples(text: str, name: str) -> dict[str, dict[str, str]]:
    """Label sets of one metric's samples, by pid."""
    return {sample.labels["pid"]: sample.labels for sample in scaffold.samples(text, name)}


@pytest.mark.e2e
def test_a_gpu_process_named_in_invalid_utf8_keeps_every_gpu_up(fake_nvml: FakeNvml) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", RENAMED, NON_UTF8.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as named:
        assert named.stdout.readline() == b"renamed\n"
        assert Path(f"/proc/{named.pid}/comm").read_bytes() == NON_UTF8 + b"\n"
        fake_nvml.processes(0, [{"pid": named.pid, "used_memory": 1 << 30, "sm_util": 40}])
        with Agent(
            "--sources",
            "nvml,procfs",
            "--nvml-library",
            str(fake_nvml.library),
            "--interval",
            "0.25s",
            "--process-metrics",
            "all",
            env=fake_nvml.env(),
        ) as agent:
            assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
            text = agent.metrics()
            expected = NON_UTF8.decode(errors="replace")
            assert (
                samples(text, "gpu_process_memory_used_bytes")[str(named.pid)]["comm"] == expected
            )
            assert (
                samples(text, "kepler_bridge_process_cpu_seconds_total")[str(named.pid)]["comm"]
                == expected
            )
            up = scaffold.values(text, "kepler_bridge_source_up", "source")
            assert up == {"nvml": 1.0, "procfs": 1.0}
        named.stdin.close()


def stat_line(pid: int, comm: bytes) -> bytes:
    return b"%d (%s) S 1 %d %d 0 -1 4194560 100 0 0 0 30 20 0 0 20 0 1 0 5000 1000000 100\n" % (
        pid,
        comm,
        pid,
        pid,
    )


# The kernel's comm is up to 15 bytes without NUL; a cgroup path is any bytes but NUL and newline.
comms = st.binary(max_size=15).filter(lambda name: b"\0" not in name)
cgroup_paths = st.binary(max_size=80).filter(lambda path: b"\0" not in path and b"\n" not in path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.tuples(comms, cgroup_paths), min_size=1, max_size=5))
def test_any_name_and_cgroup_bytes_read_and_render(names: list[tuple[bytes, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as root:
        proc = Path(root)
        for pid, (comm, cgroup) in enumerate(names, start=100):
            (proc / str(pid)).mkdir()
            (proc / str(pid) / "stat").write_bytes(stat_line(pid, comm))
            (proc / str(pid) / "cgroup").write_bytes(b"0::/" + cgroup + b"\n")
        (proc / "self").symlink_to("100")
        settings_ = scaffold.make_config(
            sources="procfs", procfs=proc, kube_source="off", pod_resources_socket=""
        )
        snapshot = Sampler(settings_, SnapshotStore()).sample()
    assert [status.up for status in snapshot.sources] == [True]
    text = prometheus.render(snapshot, lambda name: True).decode()
    found = samples(text, "kepler_bridge_process_cpu_seconds_total")
    assert {pid: labels["comm"] for pid, labels in found.items()} == {
        # Escape sequences and control characters are stripped, as from every text of a source.
        str(pid): printable(comm.decode(errors="replace"))
        for pid, (comm, _) in enumerate(names, start=100)
    }
