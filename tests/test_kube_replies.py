"""Kube endpoints that answer too much or too slowly: replies are bounded in bytes
(kube_max_reply_bytes) and each request in total time (kube_timeout), and the last good
metadata stays."""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from pathlib import Path

import pytest

from agent import Agent
from kepler_bridge.kube.pod_resources import MAX_DEVICE_IDS
from kepler_bridge.kube.view import device_key
from kepler_bridge.model import PodRef
from kubefakes import (
    FakeKube,
    FakePodResources,
    dribbled,
    http_answer,
    huge_pod_list,
    list_response,
    pod,
    pod_list,
    self_signed,
)
from scaffold import by_name, stat_line
from test_kube import EXPECTED, PODS, metadata

MIB = 2**20


def status_kib(key: str, pid: int | str = "self") -> int:
    """A figure of /proc/<pid>/status in KiB: VmRSS now, VmHWM the peak."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB$", text, re.M).group(1))  # type: ignore[union-attr]


def peak_growth_mib(action: object) -> float:
    """How far this process's peak RSS rose above its RSS while `action()` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # peak := now
    before = status_kib("VmRSS")
    action()  # type: ignore[operator]
    return (status_kib("VmHWM") - before) / 1024


def refused(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if words in record.getMessage()]


def test_a_150_mb_pod_list_is_refused_unread_and_the_last_list_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with FakeKube(PODS) as metaserver:
        kube = metadata(kube_source="metaserver", metaserver_url=metaserver.url)
        kube.refresh()
        metaserver.raw = lambda: huge_pod_list(150 * MIB)
        with caplog.at_level(logging.INFO, logger="kepler_bridge.kube.metadata"):
            grown = peak_growth_mib(lambda: (kube.refresh(), kube.refresh()))
        assert len(metaserver.requests) == 3
    assert kube.view().containers == EXPECTED
    assert "over kube_max_reply_bytes (16777216 bytes)" in kube.errors["pods"]
    assert "keeping the last pod list" in kube.errors["pods"]
    (line,) = refused(caplog, "kube_max_reply_bytes")  # twice refused, logged once
    assert "raise kube_max_reply_bytes" in line
    # The default cap is 16 MiB: about that much is held, never the 150 MB.
    assert grown < 48, f"peak RSS grew {grown:.0f} MiB reading a 150 MB reply"


def test_a_declared_length_over_the_cap_is_refused_before_the_body(tmp_path: Path) -> None:
    filler = [pod("big", f"p-{n}", ("main", f"containerd://{n:064x}")) for n in range(400)]
    with FakeKube(pod_list(*filler)) as metaserver:
        kube = metadata(
            kube_source="metaserver",
            metaserver_url=metaserver.url,
            kube_max_reply_bytes=str(64 * 1024),
        )
        kube.refresh()
    assert "over kube_max_reply_bytes (65536 bytes)" in kube.errors["pods"]


def test_a_dense_reply_under_the_cap_is_refused_before_parsing() -> None:
    """Nested empty lists cost ~30 bytes of memory per byte once parsed: a reply with more JSON
    values than a pod list of the cap's size can have is refused uncounted."""
    dense = b'{"items":[' + b",".join([b"[[]]"] * (6 * MIB // 5)) + b"]}"
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + dense
    with FakeKube(PODS) as metaserver:
        kube = metadata(kube_source="metaserver", metaserver_url=metaserver.url)
        kube.refresh()
        metaserver.raw = lambda: [answer]
        grown = peak_growth_mib(kube.refresh)
    assert kube.view().containers == EXPECTED
    assert "JSON values" in kube.errors["pods"] and "kube_max_reply_bytes" in kube.errors["pods"]
    assert grown < 48, f"peak RSS grew {grown:.0f} MiB on a 6 MiB reply"


def test_a_big_real_pod_list_under_the_cap_costs_about_its_size() -> None:
    """Only the fields the agent reads are kept while parsing (a full parse costs ~5x)."""
    env = [{"name": f"VARIABLE_{n}", "value": f"value-{n}"} for n in range(60)]
    pods = []
    for n in range(1000):
        item = pod("big", f"p-{n}", ("main", f"containerd://{n:064x}"))
        item["spec"]["containers"][0]["env"] = env
        pods.append(item)
    answer = http_answer(pod_list(*pods))
    body = answer[answer.index(b"\r\n\r\n") + 4 :]
    assert 2 * MIB < len(body) < 4 * MIB
    with FakeKube(PODS) as metaserver:
        kube = metadata(kube_source="metaserver", metaserver_url=metaserver.url)
        metaserver.raw = lambda: [answer]
        grown = peak_growth_mib(kube.refresh)
    assert len(kube.view().containers) == 1000 and kube.errors["pods"] == ""
    assert grown < 4 * len(body) / MIB, f"peak RSS grew {grown:.0f} MiB"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("where", ["head", "body"])
def test_a_dribbling_endpoint_is_cut_at_kube_timeout(
    where: str, scheme: str, tls: tuple[Path, Path]
) -> None:
    answer = http_answer(PODS)
    sent_at_once = answer.index(b"\r\n\r\n") + 4 if where == "body" else 0
    with FakeKube(PODS, tls=tls if scheme == "https" else None) as metaserver:
        kube = metadata(
            kube_source="metaserver",
            metaserver_url=metaserver.url,
            kube_ca_file=tls[0],
            kube_timeout="1s",
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED
        metaserver.raw = lambda: itertools.chain(
            [answer[:sent_at_once]], dribbled(answer[sent_at_once:], 0.2)
        )
        refresh = threading.Thread(target=kube.refresh, daemon=True)
        started = time.monotonic()
        refresh.start()
        refresh.join(15)
        took = time.monotonic() - started
    assert not refresh.is_alive(), "a reply of one byte every 0.2 s held the refresh"
    assert took < 5, f"cut after {took:.1f} s, kube_timeout is 1 s"  # generous: a loaded machine
    assert "within kube_timeout (1 s)" in kube.errors["pods"]
    assert kube.view().containers == EXPECTED


def test_pod_resources_reply_bounded_in_bytes_and_time(tmp_path: Path) -> None:
    socket = tmp_path / "kubelet.sock"
    devices = [(f"c-{n}", [("nvidia.com/gpu", [f"GPU-{n:032x}"])]) for n in range(2000)]
    with FakePodResources(socket, list_response([("ml", "big", devices)])) as server:
        kube = metadata(
            kube_source="off", pod_resources_socket=socket, kube_max_reply_bytes=str(64 * 1024)
        )
        kube.refresh()
        assert "kube_max_reply_bytes" in kube.errors["devices"]
        server.delay = 3.0
        slow = metadata(kube_source="off", pod_resources_socket=socket, kube_timeout="1s")
        started = time.monotonic()
        slow.refresh()
        assert time.monotonic() - started < 2.5
    assert "DEADLINE_EXCEEDED" in slow.errors["devices"]
    assert "within kube_timeout (1 s)" in slow.errors["devices"]


def test_pod_resources_with_more_device_ids_than_any_node_is_refused(tmp_path: Path) -> None:
    """Empty device ids cost two bytes each on the wire: a reply under kube_max_reply_bytes could
    still carry millions (gigabytes as objects). Past MAX_DEVICE_IDS it is an error, fast; the
    kubelet's names are made printable."""
    socket = tmp_path / "kubelet.sock"
    flood = [("main", [("nvidia.com/gpu", [""] * (MAX_DEVICE_IDS + 1))])]
    named = [("c\x1b[2J\u202e", [("nvidia.com/gpu", ["GPU-1", ""])])]
    with FakePodResources(socket, list_response([("ml", "flood", flood)])) as server:
        kube = metadata(kube_source="off", pod_resources_socket=socket)
        started = time.monotonic()
        kube.refresh()
        assert time.monotonic() - started < 5
        assert f"more than {MAX_DEVICE_IDS} device ids" in kube.errors["devices"]
        server.response = list_response([("ml\u202e", "job\x07", named)])
        kube.refresh()
        assert not kube.errors["devices"], kube.errors
        assert dict(kube.view().devices) == {device_key("GPU-1"): (PodRef("ml", "job", "c"),)}


def add_process(proc: Path, pid: int, container_id: str) -> None:
    """A process of the fake /proc in that container ('' for a host process)."""
    (proc / str(pid)).mkdir(parents=True)
    scope = f"/kubepods.slice/cri-containerd-{container_id}.scope" if container_id else "/init"
    (proc / str(pid) / "cgroup").write_text(f"0::{scope}\n")
    (proc / str(pid) / "stat").write_text(stat_line(pid, f"proc-{pid}", 100, 10, pid))


def owner(agent: Agent, container_id: str) -> PodRef | None:
    """The pod labels of the container's series on /metrics."""
    for labels, _ in by_name(agent.metrics()).get("kepler_bridge_container_cpu_seconds_total", []):
        if labels["container_id"] == container_id:
            return PodRef(labels["namespace"], labels["pod"], labels["container"])
    return None


@pytest.mark.e2e
def test_agent_survives_a_huge_then_a_dribbling_metaserver(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    add_process(proc, 1, "")
    (proc / "self").symlink_to("1")
    a, new = next(iter(EXPECTED)), ["1" * 64, "2" * 64, "3" * 64, "4" * 64]
    add_process(proc, 10, a)
    with (
        FakeKube(PODS) as metaserver,
        Agent(
            *("--sources", "procfs", "--procfs", str(proc), "--interval", "200ms"),
            *("--kube-source", "metaserver", "--metaserver-url", metaserver.url),
            *("--kube-timeout", "1s"),
        ) as agent,
    ):
        agent.wait_for(lambda: owner(agent, a) == EXPECTED[a], 20, "pod labels of the first list")
        (worker,) = agent.worker_pids()
        before = status_kib("VmHWM", worker)
        metaserver.raw = lambda: huge_pod_list(150 * MIB)
        for pid, container_id in ((11, new[0]), (12, new[1])):  # unknown: each asks again, soon
            asked = len(metaserver.requests)
            add_process(proc, pid, container_id)
            agent.wait_for(lambda: metaserver.answered > asked, 20, "a pod list for the new id")
        peak = status_kib("VmHWM", worker)
        assert peak < 150 * 1024, (
            f"worker peak RSS {peak / 1024:.0f} MiB (before {before / 1024:.0f})"
        )
        assert agent.output().count("raise kube_max_reply_bytes") == 1
        assert owner(agent, a) == EXPECTED[a]  # the last good list stays

        metaserver.raw = lambda: dribbled(http_answer(PODS), 0.2)
        add_process(proc, 13, new[2])
        agent.wait_for(lambda: "within kube_timeout (1 s)" in agent.output(), 20, "the cut")
        # The kube thread goes on: the next refresh reads a good list again.
        metaserver.pods = pod_list(
            *PODS["items"], pod("ml", "late-0", ("main", f"containerd://{new[2]}"))
        )
        metaserver.raw = None
        add_process(proc, 14, new[3])
        agent.wait_for(
            lambda: owner(agent, new[2]) == PodRef("ml", "late-0", "main"), 20, "new labels"
        )
