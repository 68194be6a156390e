"""Kubernetes metadata: pod lists from a fake kubelet (HTTPS, token), API server and MetaServer;
caching; labels."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import Agent
from cpu_helpers import Burner
from kepler_bridge.kube.metadata import NOTICE_ASKS, KubeMetadata
from kepler_bridge.kube.pods import STATUS_LISTS, containers_of
from kepler_bridge.kube.view import Assignment, KubeView, device_key, device_owners
from kepler_bridge.model import GpuProcess, GpuReading, PodRef
from kepler_bridge.sampling.sampler import join_owners
from kubefakes import FakeKube, pod, pod_list, self_signed
from powercap import PowercapTree
from scaffold import by_name, make_config, require, wait_for

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
PODS = pod_list(
    pod(
        "shop",
        "web-1",
        ("nginx", f"containerd://{A}"),
        ("sidecar", f"cri-o://{B}"),
        ("late", ""),
        init=(("migrate", f"containerd://{C}"),),
    ),
    pod("ml", "train-0", ("main", f"docker://{D}")),
)
EXPECTED = {
    A: PodRef("shop", "web-1", "nginx"),
    B: PodRef("shop", "web-1", "sidecar"),
    C: PodRef("shop", "web-1", "migrate"),
    D: PodRef("ml", "train-0", "main"),
}
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def metadata(environ: dict[str, str] | None = None, **settings: object) -> KubeMetadata:
    settings.setdefault("pod_resources_socket", "")
    settings.setdefault("kube_timeout", "2s")
    return KubeMetadata(make_config(**settings), environ=environ or {}, min_period=0.05)


def test_pod_list_gives_every_started_container_by_runtime_id() -> None:
    assert containers_of(PODS) == EXPECTED
    with pytest.raises(ValueError, match="not a PodList"):
        containers_of(["not", "a", "pod", "list"])


def test_pod_list_names_are_made_printable_and_encodable() -> None:
    """A JSON escape can carry a lone surrogate, which no UTF-8 writer takes (every /metrics
    scrape failed on it), and names can carry escape sequences: both are cleaned on the way in."""
    body = (
        b'{"items": [{"metadata": {"namespace": "ml\\u001b[2J", "name": "job\\u202e"}, '
        b'"status": {"containerStatuses": [{"name": "trainer\\udc80", '
        b'"containerID": "containerd://abc"}]}}]}'
    )
    assert containers_of(json.loads(body)) == {"abc": PodRef("ml", "job", "trainer?")}


def test_kubelet_over_https_with_token_and_ca(tls: tuple[Path, Path], token_file: Path) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet:
        kube = metadata(
            kube_source="kubelet",
            kubelet_url=kubelet.url,
            kube_token_file=token_file,
            kube_ca_file=tls[0],
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED
        assert kubelet.requests == [("/pods", f"Bearer {TOKEN}")]
        assert kube.errors == {"pods": ""}


def test_kubelet_address_defaults_to_node_ip() -> None:
    for environ, url in (
        ({"NODE_IP": "10.0.0.5"}, "https://10.0.0.5:10250/pods"),
        ({"NODE_IP": "fd00::5"}, "https://[fd00::5]:10250/pods"),
        ({}, "https://127.0.0.1:10250/pods"),
    ):
        kube = KubeMetadata(make_config(kube_source="kubelet"), environ=environ)
        assert [endpoint.url for endpoint in kube.endpoints] == [url]


def test_refused_token_and_untrusted_certificate_say_what_to_change(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("nope")
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet:
        kube = metadata(
            kube_source="kubelet",
            kubelet_url=kubelet.url,
            kube_token_file=wrong,
            kube_ca_file=tls[0],
        )
        kube.refresh()
        assert kube.view().containers == {}
        assert (
            "answered 401" in kube.errors["pods"]
            and f"the token in {wrong} was refused" in kube.errors["pods"]
        )
        untrusted = metadata(
            kube_source="kubelet",
            kubelet_url=kubelet.url,
            kube_token_file=wrong,
            kube_ca_file=tmp_path / "no-such-ca.crt",
        )
        untrusted.refresh()
        assert "certificate is not trusted" in untrusted.errors["pods"]
        assert "kube_insecure_skip_tls_verify=true" in untrusted.errors["pods"]


def test_insecure_skip_tls_verify(tls: tuple[Path, Path], token_file: Path, tmp_path: Path) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet:
        kube = metadata(
            kube_source="kubelet",
            kubelet_url=kubelet.url,
            kube_token_file=token_file,
            kube_ca_file=tmp_path / "none",
            kube_insecure_skip_tls_verify="true",
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED


def test_api_server_filtered_by_node_name(tls: tuple[Path, Path], token_file: Path) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as apiserver:
        environ = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(apiserver.port),
        }
        kube = metadata(
            environ,
            kube_source="apiserver",
            node_name="edge-1",
            kube_token_file=token_file,
            kube_ca_file=tls[0],
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED
        ((path, authorization),) = apiserver.requests
        assert urlsplit(path).path == "/api/v1/pods" and authorization == f"Bearer {TOKEN}"
        assert parse_qs(urlsplit(path).query) == {
            "fieldSelector": ["spec.nodeName=edge-1"],
            "resourceVersion": ["0"],  # from the API server's cache, not a quorum read of etcd
        }


def test_api_server_outside_a_pod_says_so() -> None:
    kube = metadata(kube_source="apiserver")
    kube.refresh()
    assert "KUBERNETES_SERVICE_HOST is not set" in kube.errors["pods"]


def test_metaserver_over_plain_http_gets_no_token(token_file: Path) -> None:
    with FakeKube(PODS) as metaserver:
        kube = metadata(
            kube_source="metaserver", metaserver_url=metaserver.url, kube_token_file=token_file
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED
        assert metaserver.requests == [("/api/v1/pods", "")]


def test_last_good_list_kept_while_the_endpoint_is_down() -> None:
    metaserver = FakeKube(PODS)
    kube = metadata(kube_source="metaserver", metaserver_url=metaserver.url)
    kube.refresh()
    metaserver.close()  # the edge node lost its MetaServer (edgecore restarting)
    kube.refresh()
    assert kube.view().containers == EXPECTED
    assert "keeping the last pod list" in kube.errors["pods"]


def test_auto_prefers_the_metaserver_then_the_kubelet(
    tls: tuple[Path, Path], token_file: Path
) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet, FakeKube(pod_list()) as metaserver:
        settings = dict(
            kube_source="auto",
            metaserver_url=metaserver.url,
            kubelet_url=kubelet.url,
            kube_token_file=token_file,
            kube_ca_file=tls[0],
        )
        kube = metadata(**settings)
        assert [endpoint.name for endpoint in kube.endpoints] == ["metaserver", "kubelet"]
        kube.refresh()
        assert kube.view().containers == {} and kubelet.requests == []
        metaserver.close()
        kube.refresh()
        kube.refresh()
        assert kube.view().containers == EXPECTED and len(kubelet.requests) == 2
    # Without a service-account token (not in a pod) auto only asks the MetaServer.
    no_token = metadata(kube_source="auto", kube_token_file=token_file.parent / "missing")
    assert [endpoint.name for endpoint in no_token.endpoints] == ["metaserver"]


def refreshing(metaserver: FakeKube) -> KubeMetadata:
    """Metadata from `metaserver`, refreshing in the background every 60 s, at least 0.05 s
    apart."""
    config = make_config(
        kube_source="metaserver", metaserver_url=metaserver.url, pod_resources_socket=""
    )
    kube = KubeMetadata(config, environ={}, period=60.0, min_period=0.05)
    kube.start()
    return kube


def test_refreshes_in_the_background_and_soon_after_an_unknown_container() -> None:
    with FakeKube(pod_list(pod("ml", "train-0", ("main", f"docker://{D}")))) as metaserver:
        kube = refreshing(metaserver)
        try:
            wait_for(
                lambda: kube.view().containers == {D: PodRef("ml", "train-0", "main")},
                5,
                "the first pod list",
                step=0.02,
            )
            metaserver.pods = PODS  # a new pod starts; its container shows up in a process's cgroup
            kube.notice([A])
            wait_for(lambda: A in kube.view().containers, 5, "the new pod's container", step=0.02)
            assert kube.view().containers == EXPECTED  # long before the 60 s period
            asked = len(metaserver.requests)
            # A is known; an unknown id asks at first sight, then after 2, 4, 8 and 16 least
            # periods (0.1, 0.2, 0.4, 0.8 s), not at every sample (each 0.05 s: a period).
            for _ in range(40):
                kube.notice([A, "f" * 64])
                time.sleep(0.05)
            assert asked + 3 <= len(metaserver.requests) <= asked + NOTICE_ASKS
            settled = len(metaserver.requests)
            for _ in range(10):
                kube.notice(["f" * 64])
                time.sleep(0.1)
            assert len(metaserver.requests) == settled, "asked NOTICE_ASKS times, no more"
        finally:
            kube.stop()
            assert "kepler-bridge-kube" not in {thread.name for thread in threading.enumerate()}


def test_a_container_listed_after_its_first_early_refresh_is_soon_known() -> None:
    """A container's first process runs before its pod list names it: the early refresh it asks
    for finds nothing, and the next asks find it, long before the period."""
    with FakeKube(pod_list(pod("ml", "train-0", ("main", f"docker://{D}")))) as metaserver:
        kube = refreshing(metaserver)
        try:
            wait_for(lambda: D in kube.view().containers, 5, "the first pod list", step=0.02)
            kube.notice([A])  # its process runs; the pod list does not name it yet
            wait_for(lambda: len(metaserver.requests) >= 2, 5, "the early refresh", step=0.02)
            metaserver.pods = PODS  # the kubelet's status now has its containerID
            wait_for(
                lambda: kube.notice([A]) or A in kube.view().containers,
                5,
                "the container known after a later ask",
                step=0.05,
            )
        finally:
            kube.stop()


def test_device_keys() -> None:
    assert (
        device_key("GPU-8a2b3c4d-0000-1111-2222-333344445555::3")
        == "gpu-8a2b3c4d-0000-1111-2222-333344445555"
    )
    assert (
        device_key("MIG-GPU-8a2b3c4d-0000-1111-2222-333344445555/1/0")
        == "gpu-8a2b3c4d-0000-1111-2222-333344445555"
    )
    assert (
        device_key("MIG-4f9e0000-aaaa-bbbb-cccc-ddddeeeeffff")
        == "mig-4f9e0000-aaaa-bbbb-cccc-ddddeeeeffff"
    )
    assert device_key("0000:03:00.0") == device_key("00000000:03:00.0") == "0000:03:00.0"


def test_gpu_process_labels() -> None:
    uuid = "GPU-8a2b3c4d-0000-1111-2222-333344445555"
    owner = PodRef("ml", "train-0", "main")
    view = KubeView(
        containers={A: PodRef("shop", "web-1", "nginx")},
        devices=device_owners([Assignment(f"{uuid}::0", "nvidia.com/gpu", owner)]),
    )
    reading = GpuReading(
        index=0,
        uuid=uuid,
        vendor="nvidia",
        model="A100",
        processes=(
            GpuProcess(1, "nginx", container_id=A),  # its own container decides
            GpuProcess(2, "Xorg"),  # a host process belongs to no pod
            GpuProcess(3, ""),  # not visible in /proc (no hostPID): the GPU's owner
            GpuProcess(4, "python", container_id=B),
        ),
    )  # a container the pod list does not name: the GPU's owner
    labelled = {
        proc.pid: (proc.owner.namespace, proc.owner.pod, proc.owner.container)
        for proc in join_owners(reading, view).processes
    }
    assert labelled == {
        1: ("shop", "web-1", "nginx"),
        2: ("", "", ""),
        3: ("ml", "train-0", "main"),
        4: ("ml", "train-0", "main"),
    }
    shared = KubeView(
        devices=device_owners(
            [
                Assignment(f"{uuid}::0", "nvidia.com/gpu", owner),
                Assignment(f"{uuid}::1", "nvidia.com/gpu", PodRef("ml", "b", "x")),
            ]
        )
    )
    assert len(shared.gpu_owners(reading)) == 2
    assert {proc.owner.pod for proc in join_owners(reading, shared).processes} == {
        ""
    }  # two owners: nobody guesses
    mig = GpuReading(
        index=0, uuid="GPU-x", vendor="nvidia", model="A100", mig_uuids=("MIG-1", "MIG-2")
    )
    by_mig = KubeView(devices=device_owners([Assignment("MIG-2", "nvidia.com/mig-1g.10gb", owner)]))
    assert by_mig.gpu_owners(mig) == (owner,)


def unified_cgroup() -> Path | None:
    return next(
        (
            root
            for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
            if (root / "cgroup.controllers").exists()
        ),
        None,
    )


@pytest.mark.e2e
def test_agent_labels_energy_with_pods_from_the_kubelet(
    tls: tuple[Path, Path], token_file: Path, tmp_path: Path
) -> None:
    root = unified_cgroup()
    require(
        root is not None, "no cgroup v2 hierarchy: the test puts a process in a container's cgroup"
    )
    cgroup = root / "kepler-bridge-kube-test" / f"crio-{B}.scope"
    try:
        cgroup.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        require(False, f"cannot create a cgroup ({err}): the test needs root")
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("intel-rapl:0", "package-0")
    try:
        with (
            FakeKube(PODS, token=TOKEN, tls=tls) as kubelet,
            tree.drawing("intel-rapl:0", watts=50.0),
            Burner(preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0")) as burner,
            Agent(
                "--sources",
                "procfs,rapl",
                "--sysfs",
                str(tree.sysfs),
                "--interval",
                "200ms",
                "--kube-source",
                "kubelet",
                "--kubelet-url",
                kubelet.url,
                "--kube-token-file",
                str(token_file),
                "--kube-ca-file",
                str(tls[0]),
                "--process-metrics",
                "all",
            ) as agent,
        ):
            burner.burn(0.3)

            def labelled() -> dict[str, list[tuple[dict[str, str], float]]]:
                found = by_name(agent.metrics())
                pods = {
                    (labels["namespace"], labels["pod"]): value
                    for labels, value in found.get("kepler_bridge_pod_cpu_joules_total", [])
                }
                return found if pods.get(("shop", "web-1"), 0) > 0 else {}

            found = agent.wait_for(labelled, what="CPU energy of pod shop/web-1")
    finally:
        cgroup.rmdir()
        cgroup.parent.rmdir()
    process = next(
        labels
        for labels, _ in found["kepler_bridge_process_cpu_joules_total"]
        if labels["pid"] == str(burner.pid)
    )
    assert (
        process["container_id"],
        process["namespace"],
        process["pod"],
        process["container"],
    ) == (B, "shop", "web-1", "sidecar")
    container = next(
        labels
        for labels, _ in found["kepler_bridge_container_cpu_seconds_total"]
        if labels["container_id"] == B
    )
    assert (container["namespace"], container["pod"], container["container"]) == (
        "shop",
        "web-1",
        "sidecar",
    )
    # Host processes: empty pod labels, in the same families.
    assert ("", "") in {
        (labels["namespace"], labels["pod"])
        for labels, _ in found["kepler_bridge_pod_cpu_joules_total"]
    }


def started(pod_status: dict) -> dict:
    """A one-pod list whose pod has this status."""
    return {"items": [{"metadata": {"namespace": "x", "name": "y"}, "status": pod_status}]}


BROKEN_LISTS = [
    {"items": None},
    {"items": [None]},
    started(None),
    started({"containerStatuses": None}),
    started({"containerStatuses": [None]}),
    started({"containerStatuses": [{"containerID": 7}]}),
    {"items": [{"metadata": "shop"}]},
]


@pytest.mark.parametrize("broken", BROKEN_LISTS)
def test_a_malformed_pod_list_is_that_endpoints_error_and_the_next_answers(
    broken: dict, tls: tuple[Path, Path], token_file: Path
) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet, FakeKube(broken) as metaserver:
        kube = metadata(
            kube_source="auto",
            metaserver_url=metaserver.url,
            kubelet_url=kubelet.url,
            kube_token_file=token_file,
            kube_ca_file=tls[0],
        )
        kube.refresh()
        assert kube.view().containers == EXPECTED
        assert metaserver.requests and kubelet.requests


def test_an_endpoint_that_does_not_speak_http_is_its_error(
    tls: tuple[Path, Path], token_file: Path
) -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        FakeKube(PODS, token=TOKEN, tls=tls) as kubelet,
    ):

        def answer_garbage() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        kube = metadata(
            kube_source="auto",
            metaserver_url=f"http://127.0.0.1:{server.getsockname()[1]}",
            kubelet_url=kubelet.url,
            kube_token_file=token_file,
            kube_ca_file=tls[0],
        )
        kube.refresh()
        thread.join(5)
        assert kube.view().containers == EXPECTED
        assert kube.errors == {"pods": ""}


KEYS = st.sampled_from(
    ["items", "metadata", "status", "namespace", "name", "containerID", *STATUS_LISTS]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4)
    | st.sampled_from([f"containerd://{A}", "docker://", "://", "cri-o://x"])
)
JSON = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=25,
)
# Mostly PodList-shaped, with anything anywhere.
STATUSES = st.lists(JSON | st.fixed_dictionaries({"containerID": JSON, "name": JSON}), max_size=3)
PODS_ISH = st.fixed_dictionaries(
    {"metadata": JSON, "status": st.dictionaries(st.sampled_from(STATUS_LISTS), STATUSES)}
)
HOSTILE = JSON | st.fixed_dictionaries({"items": st.lists(JSON | PODS_ISH, max_size=3)})


def test_hostile_pod_lists_never_escape_the_fallback_chain(
    tls: tuple[Path, Path], token_file: Path
) -> None:
    with FakeKube(PODS, token=TOKEN, tls=tls) as kubelet, FakeKube(pod_list()) as metaserver:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=HOSTILE)
        def check(body: object) -> None:
            metaserver.pods = body
            kube = metadata(
                kube_source="auto",
                metaserver_url=metaserver.url,
                kubelet_url=kubelet.url,
                kube_token_file=token_file,
                kube_ca_file=tls[0],
            )
            kube.refresh()
            try:
                expected = containers_of(body)
            except ValueError:
                expected = EXPECTED  # that endpoint's error: the kubelet answered
            assert kube.view().containers == expected

        check()
