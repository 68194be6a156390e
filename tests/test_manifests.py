"""Deployment manifests: generated files up to date, valid for Kubernetes 1.28+,
and the deployment contract."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from assets import ROOT, generator
from scaffold import require

MANIFESTS = ROOT / "manifests"
FILES = sorted(MANIFESTS.rglob("*.yaml"))
# Every Kubernetes minor from 1.28 to the newest whose schemas kubernetes-validate ships.
VERSIONS = sorted(
    {v for v in kv.all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 28)},
    key=lambda v: tuple(map(int, v.split("."))),
)
CRD_GROUPS = ("monitoring.coreos.com/",)
FOLDERS = ("kubernetes", "kubeedge", "baetyl/cluster", "baetyl/single-node")
# Subfolders that need their parent folder applied first (namespace, account, RBAC, alert rules).
SUBFOLDERS = ("hardened", "ascend")
# Prometheus in agent mode beside the agent on edge nodes, opt-in (manifests/README.md).
REMOTE_WRITE = "remote-write"
REMOTE_WRITE_FOLDERS = ("kubeedge", "baetyl/cluster", "baetyl/single-node")
ASCEND_NODE_LABEL = "feature.node.kubernetes.io/pci-1200_19e5.present"
PORT = 30060
SECCOMP_PROFILE = MANIFESTS / "seccomp" / "kepler-bridge.json"
SECCOMP_BASE = MANIFESTS / "seccomp" / "containers-common-0.50.1.json"
# Keys of the OCI runtime spec's LinuxSeccomp, the only format containerd reads for Localhost
# profiles.
OCI_SECCOMP_KEYS = {
    "defaultAction",
    "defaultErrnoRet",
    "architectures",
    "flags",
    "listenerPath",
    "listenerMetadata",
    "syscalls",
}
OCI_SYSCALL_KEYS = {"names", "action", "errnoRet", "args"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _all_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in FILES for doc in _docs(path)]


def _workloads() -> list[tuple[Path, dict[str, Any]]]:
    """The agent's workloads (remote-write/ holds Prometheus': _remote_write_workloads)."""
    return [
        (path, doc)
        for path, doc in _all_docs()
        if doc["kind"] in ("DaemonSet", "Deployment") and REMOTE_WRITE not in path.parts
    ]


def _remote_write_workloads() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, doc)
        for path, doc in _all_docs()
        if doc["kind"] in ("DaemonSet", "Deployment") and REMOTE_WRITE in path.parts
    ]


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.relative_to(MANIFESTS)}:{doc['kind']}/{doc['metadata']['name']}"


def test_manifest_files_match_the_generator() -> None:
    for path, text in generator("manifests/render.py").rendered().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is out of date: run python scripts/render_assets.py"
        )


def test_every_yaml_file_is_generated() -> None:
    render = generator("manifests/render.py")
    generated = {path for path in render.rendered() if path.suffix == ".yaml"}
    generated |= {
        path for path in generator("alerts/render.py").rendered() if path.suffix == ".yaml"
    }
    assert set(FILES) == generated, f"hand-written or stale files: {set(FILES) ^ generated}"


def test_seccomp_folder_holds_the_generated_profile_and_its_base() -> None:
    generated = {
        path
        for path in generator("manifests/render.py").rendered()
        if path.parent == SECCOMP_PROFILE.parent
    }
    assert generated == {SECCOMP_PROFILE}
    assert set(SECCOMP_PROFILE.parent.iterdir()) == {SECCOMP_PROFILE, SECCOMP_BASE}, (
        "hand-written or stale files"
    )


def _is_crd(item: tuple[Path, dict[str, Any]]) -> bool:
    return item[1]["apiVersion"].startswith(CRD_GROUPS)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", [item for item in _all_docs() if not _is_crd(item)], ids=_id)
def test_manifest_validates_against_kubernetes_schema(
    item: tuple[Path, dict[str, Any]], version: str
) -> None:
    try:
        kv.validate(item[1], version, strict=True)
    except kv.ValidationError as err:
        path = ".".join(str(part) for part in err.path)
        pytest.fail(f"invalid for Kubernetes {version} at {path}: {err.message}", pytrace=False)


@pytest.mark.parametrize("item", [item for item in _all_docs() if _is_crd(item)], ids=_id)
def test_crd_manifest_schema(item: tuple[Path, dict[str, Any]]) -> None:
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(item[1], VERSIONS[-1], strict=True)
    checked_by = {
        "ServiceMonitor": "test_servicemonitor_scrapes_the_service",
        "PrometheusRule": "promtool in test_alerts.py",
    }[item[1]["kind"]]
    pytest.skip(
        f"{item[1]['kind']} ({item[1]['apiVersion']}) is a prometheus-operator CRD: "
        "kubernetes-validate "
        f"ships no schema for it and none is vendored here; checked by {checked_by} instead"
    )


def test_image_tag_is_the_package_version() -> None:
    version = re.search(
        r'__version__ = "([^"]+)"', (ROOT / "kepler_bridge" / "__init__.py").read_text()
    )
    assert version, "kepler_bridge/__init__.py has no __version__"
    for item in _workloads():
        (container,) = item[1]["spec"]["template"]["spec"]["containers"]
        assert container["image"].endswith(f":{version.group(1)}"), _id(item)


@pytest.mark.parametrize("item", _workloads(), ids=_id)
def test_workload_meets_the_deployment_contract(item: tuple[Path, dict[str, Any]]) -> None:
    _, doc = item
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The task iterator and NVML see only the caller's pid namespace (manifests/README.md, "Host
    # PID namespace"); nothing uses the host's System V IPC or shared memory.
    assert pod["hostPID"] is True and "hostIPC" not in pod
    args = container["args"]
    assert args[0] == "serve"
    procfs, sysfs = args[args.index("--procfs") + 1], args[args.index("--sysfs") + 1]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {path: volumes[m["name"]].get("hostPath", {}).get("path") for path, m in mounts.items()}
    assert host[procfs] == "/proc" and host[sysfs] == "/sys"
    for path in (procfs, sysfs, "/lib/modules", "/usr/src"):
        assert mounts[path].get("readOnly") is True, path
        assert host[path] is not None, path
    # The programs attach through BPF links (task iterator, raw tracepoint): no debugfs or tracefs.
    assert not {"/sys/kernel/debug", "/sys/kernel/tracing"} & set(mounts)
    env = {e["name"]: e for e in container["env"]}
    assert env["KUBE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["ports"] == [{"name": "metrics", "containerPort": PORT, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "96Mi"},
        "limits": {"cpu": "500m", "memory": "256Mi"},
    }
    strategy = doc["spec"].get("updateStrategy") or doc["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"


@pytest.mark.parametrize("item", _workloads(), ids=_id)
def test_variant_security_settings(item: tuple[Path, dict[str, Any]]) -> None:
    path, doc = item
    pod = doc["spec"]["template"]["spec"]
    security = pod["containers"][0]["securityContext"]
    if path.parent.name == "hardened":
        assert doc["spec"]["template"]["metadata"]["labels"]["variant"] == "hardened"
        assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        # Only on KubeEdge, where no pod-resources socket exists, the environment reading needs
        # CAP_SYS_PTRACE: test_only_the_hardened_kubeedge_pod_may_read_other_containers_environ.
        reads_environ = path.parent.parent.name == "kubeedge"
        assert security["capabilities"] == {
            "drop": ["ALL"],
            "add": ["BPF", "PERFMON", "SYS_RESOURCE", *(["SYS_PTRACE"] * reads_environ)],
        }
        # The kubelet reads Localhost profiles relative to /var/lib/kubelet/seccomp;
        # manifests/seccomp/ is that folder.
        assert security["seccompProfile"] == {
            "type": "Localhost",
            "localhostProfile": SECCOMP_PROFILE.name,
        }
        assert SECCOMP_PROFILE.is_file()
        host_paths = [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
        assert not [path for path in host_paths if path == "/usr" or path.startswith("/usr/lib")], (
            "hardened relies on the NVIDIA container toolkit"
        )
    else:
        assert doc["spec"]["template"]["metadata"]["labels"]["variant"] == "privileged"
        assert security["privileged"] is True
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        # A directory: the host's /usr, whose driver layouts (amd64, arm64, Jetson, RHEL)
        # the agent searches.
        library = env["KEPLER_BRIDGE_NVML_LIBRARY"]
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[library]["name"] == "nvidia-driver" and mounts[library]["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["nvidia-driver"]["hostPath"] == {"path": "/usr", "type": "Directory"}


@pytest.mark.parametrize("folder", FOLDERS)
def test_hardened_variant_replaces_the_privileged_one(folder: str) -> None:
    (privileged_file,) = (MANIFESTS / folder).glob("30-*.yaml")
    (plain,) = _docs(privileged_file)
    (hardened,) = _docs(MANIFESTS / folder / "hardened" / privileged_file.name)
    for key in ("apiVersion", "kind"):
        assert plain[key] == hardened[key]
    assert plain["metadata"]["name"] == hardened["metadata"]["name"]
    assert plain["metadata"]["namespace"] == hardened["metadata"]["namespace"]
    assert plain["spec"]["selector"] == hardened["spec"]["selector"], "the selector is immutable"


@pytest.mark.parametrize("folder", ["kubernetes", "kubeedge"])
def test_folder_applies_in_order(folder: str) -> None:
    names = sorted(path.name for path in (MANIFESTS / folder).glob("*.yaml"))
    assert names[0] == "00-namespace.yaml", (
        "kubectl apply -f takes files in name order: namespace first"
    )
    assert all(re.fullmatch(r"\d\d-[a-z]+\.yaml", name) for name in names), names


def test_kubeedge_shares_namespace_account_and_alerts_with_kubernetes() -> None:
    for name in ("00-namespace.yaml", "10-serviceaccount.yaml", "70-prometheusrule.yaml"):
        assert _docs(MANIFESTS / "kubeedge" / name) == _docs(MANIFESTS / "kubernetes" / name), name


@pytest.mark.parametrize("item", _workloads(), ids=_id)
def test_token_is_mounted_only_where_pod_names_come_from_the_api_server(
    item: tuple[Path, dict[str, Any]],
) -> None:
    path, doc = item
    pod = doc["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    expected = "metaserver" if "kubeedge" in path.parts else "apiserver"
    assert env["KEPLER_BRIDGE_KUBE_SOURCE"] == expected
    assert pod["automountServiceAccountToken"] is (expected == "apiserver")
    folder = path.parent.parent if path.parent.name in SUBFOLDERS else path.parent
    has_rbac = (folder / "20-rbac.yaml").exists()
    assert has_rbac is (expected == "apiserver"), "grant pod reads exactly where the token is used"


def test_namespace_sets_pod_security_level() -> None:
    (namespace,) = _docs(MANIFESTS / "kubernetes" / "00-namespace.yaml")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {"pod-security.kubernetes.io/audit", "pod-security.kubernetes.io/warn"} <= set(labels)


def test_rbac_is_read_only_on_pods() -> None:
    role, binding = _docs(MANIFESTS / "kubernetes" / "20-rbac.yaml")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kepler-bridge", "namespace": "kepler-bridge"}
    ]


@pytest.mark.parametrize("folder", ["kubernetes", "kubernetes/ascend"])
def test_network_policy_admits_only_the_metrics_port(folder: str) -> None:
    (policy,) = _docs(MANIFESTS / folder / "50-networkpolicy.yaml")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": PORT, "protocol": "TCP"}]}]
    (daemonset,) = _docs(MANIFESTS / folder / "30-daemonset.yaml")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize("folder", ["kubernetes", "kubeedge", "kubernetes/ascend"])
def test_servicemonitor_scrapes_the_service(folder: str) -> None:
    (service,) = _docs(MANIFESTS / folder / "40-service.yaml")
    (monitor,) = _docs(MANIFESTS / folder / "60-servicemonitor.yaml")
    (daemonset,) = _docs(MANIFESTS / folder / "30-daemonset.yaml")
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {
        "matchNames": [service["metadata"]["namespace"]]
    }
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels"}
    # The operator's namespace, pod and container target labels would replace the workload's.
    assert endpoint["honorLabels"] is True
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert (
        service["spec"]["selector"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    # KeplerBridgeDown matches job=~".*kepler-bridge.*"; the job label is the Service's name.
    assert "kepler-bridge" in service["metadata"]["name"]


def test_only_the_hardened_kubeedge_pod_may_read_other_containers_environ() -> None:
    """EdgeCore serves no pod-resources: the devices' holders come from the containers'
    /proc/<pid>/environ, which the kernel's ptrace access check opens only with CAP_SYS_PTRACE.
    Where pod-resources serves (the kubelet, baetyl's k3s) no hardened pod gets it. The seccomp
    profile stays the one resolved without it: what the runtime allows only with CAP_SYS_PTRACE
    (kcmp, process_madvise) stays refused, and so do the calls through which the capability acts
    on another process (ptrace, process_vm_readv/writev, pidfd_getfd), which the base allows."""
    with_ptrace = {
        path.relative_to(MANIFESTS).as_posix()
        for path, doc in _workloads()
        if "SYS_PTRACE"
        in doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]
        .get("capabilities", {})
        .get("add", [])
    }
    assert with_ptrace == {"kubeedge/hardened/30-daemonset.yaml"}
    text = (MANIFESTS / "kubeedge" / "hardened" / "30-daemonset.yaml").read_text(encoding="utf-8")
    comment = text[: text.index("- SYS_PTRACE")].rsplit("- SYS_RESOURCE", 1)[1]
    assert "/proc/<pid>/environ" in comment and "pod-resources" in comment, comment
    profile = json.loads(SECCOMP_PROFILE.read_text(encoding="utf-8"))
    base = json.loads(SECCOMP_BASE.read_text(encoding="utf-8"))
    for name in ("kcmp", "process_madvise"):
        (rule,) = [rule for rule in profile["syscalls"] if name in rule["names"]]
        assert rule["action"] == "SCMP_ACT_ERRNO", name

    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"):
        assert [rule["action"] for rule in base["syscalls"] if name in rule["names"]] == [
            "SCMP_ACT_ALLOW"
        ], name
        (rule,) = [rule for rule in profile["syscalls"] if name in rule["names"]]
        assert (rule["action"], rule["errnoRet"]) == ("SCMP_ACT_ERRNO", 1), name


def test_kubeedge_runs_only_on_edge_gpu_nodes_and_survives_disconnection() -> None:
    for path in (
        MANIFESTS / "kubeedge" / "30-daemonset.yaml",
        MANIFESTS / "kubeedge" / "hardened" / "30-daemonset.yaml",
    ):
        (daemonset,) = _docs(path)
        pod = daemonset["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["feature.node.kubernetes.io/gpu"] == "true"
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [
            {"matchExpressions": [{"key": "node-role.kubernetes.io/edge", "operator": "Exists"}]}
        ]
        tolerated = {t.get("key") for t in pod["tolerations"]}
        assert {"node-role.kubernetes.io/edge", "node.kubernetes.io/unreachable"} <= tolerated
    (cloud,) = _docs(MANIFESTS / "kubernetes" / "30-daemonset.yaml")
    terms = cloud["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    assert terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "node-role.kubernetes.io/edge", "operator": "DoesNotExist"},
                {"key": ASCEND_NODE_LABEL, "operator": "DoesNotExist"},
            ]
        }
    ]


def test_ascend_variant_gives_npu_smi_the_host_driver_on_ascend_nodes_only() -> None:
    (workload,) = _docs(MANIFESTS / "kubernetes" / "ascend" / "30-daemonset.yaml")
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {
        m["mountPath"]: volumes[m["name"]]["hostPath"]
        for m in container["volumeMounts"]
        if "hostPath" in volumes[m["name"]] and m.get("readOnly")
    }
    # The ascend source runs --npu-smi: the host's own npu-smi, with the driver,
    # DCMI and install record it reads.
    assert host[env["KEPLER_BRIDGE_NPU_SMI"]] == {"path": "/usr/local/sbin/npu-smi", "type": "File"}
    assert host["/usr/local/Ascend/driver"] == {
        "path": "/usr/local/Ascend/driver",
        "type": "Directory",
    }
    assert host["/usr/local/dcmi"]["path"] == "/usr/local/dcmi"
    assert host["/etc/ascend_install.info"] == {"path": "/etc/ascend_install.info", "type": "File"}
    libraries = env["LD_LIBRARY_PATH"].split(":")
    assert {
        "/usr/local/Ascend/driver/lib64/driver",
        "/usr/local/Ascend/driver/lib64/common",
    } <= set(libraries)
    for directory in libraries:
        assert any(directory == path or directory.startswith(path + "/") for path in host), (
            directory
        )
    # One agent per node: the Ascend DaemonSet where NFD labels Huawei NPUs,
    # the other one everywhere else.
    assert pod["nodeSelector"][ASCEND_NODE_LABEL] == "true"
    (other,) = _docs(MANIFESTS / "kubernetes" / "30-daemonset.yaml")
    affinity = other["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": ASCEND_NODE_LABEL, "operator": "DoesNotExist"} in term["matchExpressions"]


@pytest.mark.parametrize(
    "folder,kind", [("baetyl/single-node", "Deployment"), ("baetyl/cluster", "DaemonSet")]
)
def test_baetyl_workload_is_found_by_baetyl_core(folder: str, kind: str) -> None:
    for path in sorted((MANIFESTS / folder).rglob("30-*.yaml")):
        if REMOTE_WRITE in path.parts:
            continue
        (workload,) = _docs(path)
        assert workload["kind"] == kind
        assert workload["metadata"]["namespace"] == "baetyl-edge-system"
        assert (
            workload["spec"]["template"]["metadata"]["labels"]["baetyl-service-name"]
            == "baetyl-accelerator-metrics"
        )
        assert (
            workload["spec"]["selector"]["matchLabels"]["baetyl-service-name"]
            == "baetyl-accelerator-metrics"
        )
    for path in (MANIFESTS / folder).glob("*.yaml"):
        for doc in _docs(path):
            assert doc["kind"] != "Namespace", "baetyl creates baetyl-edge-system itself"
            if "namespace" in doc["metadata"]:
                assert doc["metadata"]["namespace"] == "baetyl-edge-system", path


def test_seccomp_profile_is_flat_oci_and_adds_only_the_ebpf_calls() -> None:
    profile = json.loads(SECCOMP_PROFILE.read_text(encoding="utf-8"))
    base = json.loads(SECCOMP_BASE.read_text(encoding="utf-8"))
    assert set(profile) <= OCI_SECCOMP_KEYS, (
        "containerd ignores other keys (includes/excludes, archMap)"
    )
    assert all(set(rule) <= OCI_SYSCALL_KEYS for rule in profile["syscalls"])
    assert (profile["defaultAction"], profile["defaultErrnoRet"]) == (
        base["defaultAction"],
        base["defaultErrnoRet"],
    )
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"]), (
        "the image's architectures"
    )
    for name in ("bpf", "perf_event_open"):
        rules = [rule for rule in profile["syscalls"] if name in rule["names"]]
        assert rules == [{"names": ["bpf", "perf_event_open"], "action": "SCMP_ACT_ALLOW"}], name
    # What the base allows only with CAP_SYS_ADMIN, which the hardened pods lack, stays refused:
    # nothing else is added.
    (admin,) = [
        rule
        for rule in base["syscalls"]
        if rule.get("includes", {}).get("caps") == ["CAP_SYS_ADMIN"]
    ]
    always = {
        name
        for rule in base["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW"
        and not rule.get("includes")
        and not rule.get("excludes")
        for name in rule["names"]
    }
    for name in set(admin["names"]) - always - {"bpf", "perf_event_open"}:
        actions = {rule["action"] for rule in profile["syscalls"] if name in rule["names"]}
        assert actions == {"SCMP_ACT_ERRNO"}, name


def test_seccomp_base_is_the_debian_package_default() -> None:
    installed = Path("/usr/share/containers/seccomp.json")
    version = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "golang-github-containers-common"],
        capture_output=True,
        text=True,
    ).stdout
    require(
        version == "0.50.1+ds1-4",
        f"golang-github-containers-common 0.50.1+ds1-4 is not installed (found "
        f"{version or 'none'}): bash scripts/apt-install.sh podman, or compare with that "
        "package's file by hand",
    )
    assert SECCOMP_BASE.read_bytes() == installed.read_bytes(), (
        f"{SECCOMP_BASE} differs from {installed}"
    )


@pytest.mark.parametrize("item", _remote_write_workloads(), ids=_id)
def test_remote_write_pod_is_unprivileged_and_bounds_its_wal(
    item: tuple[Path, dict[str, Any]],
) -> None:
    path, doc = item
    remote = generator("manifests/remote_write.py")
    pod = doc["spec"]["template"]["spec"]
    assert "hostPID" not in pod and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert not [v for v in volumes.values() if "hostPath" in v], (
        "Prometheus needs nothing of the host"
    )
    (prometheus,) = pod["containers"]
    (render,) = pod["initContainers"]
    for container in (prometheus, render):
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["allowPrivilegeEscalation"] is False
        assert container["image"] == remote.PROMETHEUS_IMAGE
    args = dict(arg.split("=", 1) if "=" in arg else (arg, "") for arg in prometheus["args"])
    assert args["--enable-feature"] == "agent"
    assert args["--storage.agent.retention.max-time"] == remote.MAX_TIME
    assert "--storage.agent.wal-compression" in args
    # The WAL lies on a disk emptyDir with a size limit: bounded, and kept across restarts of the
    # container.
    mounts = {m["mountPath"]: m["name"] for m in prometheus["volumeMounts"]}
    wal = volumes[mounts[str(Path(args["--storage.agent.path"]).parent)]]
    assert wal["emptyDir"] == {"sizeLimit": remote.WAL_SIZE_LIMIT}
    assert volumes["secret"]["secret"]["secretName"] == "kepler-bridge-remote-write"
    assert volumes["secret"]["secret"]["defaultMode"] == 0o440
    (configmap,) = _docs(path.parent / "10-configmap.yaml")
    assert volumes["template"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert configmap["metadata"]["namespace"] == doc["metadata"]["namespace"]


@pytest.mark.parametrize("folder", REMOTE_WRITE_FOLDERS)
def test_remote_write_scrapes_the_agent_of_its_own_node(folder: str) -> None:
    (configmap,) = _docs(MANIFESTS / folder / REMOTE_WRITE / "10-configmap.yaml")
    config = yaml.safe_load(configmap["data"]["prometheus.yml"])
    (job,) = config["scrape_configs"]
    # KeplerBridgeDown matches job=~".*kepler-bridge.*".
    assert "kepler-bridge" in job["job_name"]
    (target,) = job["static_configs"][0]["targets"]
    (agent,) = _docs(next((MANIFESTS / folder).glob("30-*.yaml")))
    agent_pod = agent["spec"]["template"]
    (workload,) = _remote_write_workloads_in(MANIFESTS / folder / REMOTE_WRITE)
    if agent_pod["spec"].get("hostNetwork"):
        assert target == f"127.0.0.1:{PORT}"
        assert workload["spec"]["template"]["spec"]["hostNetwork"] is True
    else:
        (service,) = _docs(MANIFESTS / folder / REMOTE_WRITE / "40-service.yaml")
        name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
        assert target == f"{name}.{namespace}.svc:{PORT}"
        assert service["spec"]["internalTrafficPolicy"] == "Local", "this node's agent only"
        assert service["spec"]["selector"].items() <= agent_pod["metadata"]["labels"].items()
    assert config["global"]["external_labels"] == {"node": "@NODE_NAME@"}
    (remote_write,) = config["remote_write"]
    assert "url" not in remote_write, "the url comes from the Secret"
    assert list(config)[-1] == "remote_write", "the init script appends to the last entry"


def _remote_write_workloads_in(folder: Path) -> list[dict[str, Any]]:
    return [doc for path, doc in _remote_write_workloads() if path.parent == folder]
