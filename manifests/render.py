"""Generate the plain-YAML deployment manifests (kubernetes/, kubeedge/, baetyl/) from one pod
template.

The objects around the pods are in cluster_objects.py, the nodes they run on in scheduling.py,
the hardened pods' seccomp profile in seccomp_profile.py, what the hardened KubeEdge pod adds in
edge_devices.py; this folder is no package, so they import by name from it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from cluster_objects import (  # noqa: E402
    NAMESPACE,
    PORT,
    labels,
    meta,
    namespace,
    network_policy,
    rbac,
    service,
    service_account,
    service_monitor,
)
from edge_devices import edge_daemonset  # noqa: E402
from remote_write import outputs as remote_write_outputs  # noqa: E402
from scheduling import cloud_scheduling, edge_scheduling  # noqa: E402
from seccomp_profile import seccomp_profile  # noqa: E402

VERSION = "0.1.0"
IMAGE = f"ghcr.io/kepler-bridge/kepler-bridge:{VERSION}"
BAETYL_NAMESPACE = "baetyl-edge-system"
GPU_NODE_SELECTOR = {"kubernetes.io/os": "linux", "feature.node.kubernetes.io/gpu": "true"}
# The host's /usr, under which every driver layout keeps libnvidia-ml.so.1 (lib/x86_64-linux-gnu,
# lib/aarch64-linux-gnu, its tegra/, lib64, local/nvidia/lib64); the agent searches it
# (manifests/README.md).
NVIDIA_DRIVER_ROOT = "/usr"
NVIDIA_DRIVER_MOUNT = "/host/usr"
# Huawei Ascend nodes, as Node Feature Discovery labels them (PCI class 1200, vendor 19e5); label
# SoC boards by hand.
ASCEND_NODE_LABEL = "feature.node.kubernetes.io/pci-1200_19e5.present"
NPU_SMI = "/usr/local/sbin/npu-smi"
# What npu-smi (the ascend source) needs from an Ascend host, as Huawei's npu-exporter and Ascend
# Docker Runtime mount it: (volume, path on host and in the container, hostPath type).
ASCEND_HOST_PATHS = (
    # The driver libraries.
    ("ascend-driver", "/usr/local/Ascend/driver", "Directory"),
    # The DCMI library; not every board's driver has it.
    ("ascend-dcmi", "/usr/local/dcmi", "DirectoryOrCreate"),
    ("npu-smi", NPU_SMI, "File"),
    # npu-smi finds the driver through it.
    ("ascend-install-info", "/etc/ascend_install.info", "File"),
)
ASCEND_LIBRARY_PATH = ":".join(
    (
        "/usr/local/Ascend/driver/lib64",
        "/usr/local/Ascend/driver/lib64/common",
        "/usr/local/Ascend/driver/lib64/driver",
        "/usr/local/dcmi",
    )
)
# The kubelet's pod-resources socket: which pod each GPU is assigned to.
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
HEADER = (
    "# Generated from manifests/render.py by scripts/render_assets.py: edit that file, not this\n"
    "# one, then run python scripts/render_assets.py (see manifests/README.md).\n"
)
# Sized from the benchmarks (RSS < 60 MB, < 80 MB with eBPF; CPU < 0.6 s/min); bcc compiles at
# start-up.
RESOURCES = {
    "requests": {"cpu": "50m", "memory": "96Mi"},
    "limits": {"cpu": "500m", "memory": "256Mi"},
}
HARDENED_CAPABILITIES = ["BPF", "PERFMON", "SYS_RESOURCE"]
# localhostProfile: relative to the kubelet's /var/lib/kubelet/seccomp.
SECCOMP_PROFILE = "kepler-bridge.json"


def host_path(name: str, path: str, kind: str = "Directory") -> dict[str, Any]:
    """A hostPath volume."""
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def mount(name: str, path: str) -> dict[str, Any]:
    """A read-only volume mount."""
    return {"name": name, "mountPath": path, "readOnly": True}


def probe(path: str, period: int, failures: int) -> dict[str, Any]:
    """An HTTP probe on the metrics port."""
    return {
        "httpGet": {"path": path, "port": "metrics"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def container(hardened: bool, extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent container: host /proc and /sys where --procfs/--sysfs point, bcc's kernel trees,
    probes."""
    env: list[dict[str, Any]] = [
        {
            "name": "KUBE_NODE_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}},
        },
        # Where the NVIDIA container toolkit is the runtime, it injects the library and devices.
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
    ]
    mounts = [
        mount("proc", "/host/proc"),
        mount("sys", "/host/sys"),
        mount("lib-modules", "/lib/modules"),
        mount("usr-src", "/usr/src"),
        mount("pod-resources", POD_RESOURCES),
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if not hardened:
        # A directory: the agent loads the first libnvidia-ml.so.1 of the driver layouts in it.
        env.append({"name": "KEPLER_BRIDGE_NVML_LIBRARY", "value": NVIDIA_DRIVER_MOUNT})
        mounts.append(mount("nvidia-driver", NVIDIA_DRIVER_MOUNT))
    return {
        "name": "kepler-bridge",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["serve", "--procfs", "/host/proc", "--sysfs", "/host/sys"],
        "env": env + extra_env,
        "ports": [{"name": "metrics", "containerPort": PORT, "protocol": "TCP"}],
        # bcc compiles the eBPF programs at start-up: up to 2 minutes on a slow edge CPU.
        "startupProbe": probe("/healthz", 2, 60),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 2),
        "resources": RESOURCES,
        "securityContext": security_context(hardened),
        "volumeMounts": mounts,
    }


def security_context(hardened: bool) -> dict[str, Any]:
    """Privileged, or hardened: root with only HARDENED_CAPABILITIES, a read-only root file system
    and the seccomp profile."""
    if hardened:
        return {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsUser": 0,
            "runAsNonRoot": False,
            "capabilities": {"drop": ["ALL"], "add": HARDENED_CAPABILITIES},
            "seccompProfile": {"type": "Localhost", "localhostProfile": SECCOMP_PROFILE},
        }
    return {"privileged": True, "runAsUser": 0}


def pod_spec(hardened: bool, kube_source: str, edge: bool = False) -> dict[str, Any]:
    """The pod: host PID namespace, read-only host trees; pod names from `kube_source`."""
    volumes = [
        host_path("proc", "/proc"),
        host_path("sys", "/sys"),
        host_path("lib-modules", "/lib/modules"),
        host_path("usr-src", "/usr/src", "DirectoryOrCreate"),
        host_path("pod-resources", POD_RESOURCES, "DirectoryOrCreate"),
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
    ]
    if not hardened:
        volumes.append(host_path("nvidia-driver", NVIDIA_DRIVER_ROOT))
    # The API server needs the account's token; edgecore's MetaServer on the node's loopback does
    # not.
    spec: dict[str, Any] = {
        "serviceAccountName": "kepler-bridge",
        "automountServiceAccountToken": kube_source == "apiserver",
        "hostPID": True,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
    }
    if edge:
        spec |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    spec["containers"] = [
        container(hardened, [{"name": "KEPLER_BRIDGE_KUBE_SOURCE", "value": kube_source}])
    ]
    spec["volumes"] = volumes
    return spec


def template(pod_labels: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    """A pod template."""
    return {"metadata": {"labels": pod_labels}, "spec": spec}


def daemonset(
    name: str,
    ns: str,
    instance: str,
    hardened: bool,
    kube_source: str = "apiserver",
    edge: bool = False,
    pod_labels: dict[str, str] | None = None,
    node_selector: dict[str, str] | None = None,
    scheduling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One agent per selected node, replaced one node at a time."""
    selector = labels(instance, component=True) | (pod_labels or {})
    spec = pod_spec(hardened, kube_source, edge)
    spec = {"nodeSelector": node_selector or GPU_NODE_SELECTOR, **(scheduling or {}), **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta(name, ns, instance)
        | {"labels": selector | {"variant": variant(hardened)}},
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": template(selector | {"variant": variant(hardened)}, spec),
        },
    }


def variant(hardened: bool) -> str:
    """The value of the `variant` label."""
    return "hardened" if hardened else "privileged"


def with_ascend(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload with the host's Ascend driver, DCMI, npu-smi and install record mounted where
    npu-smi wants them."""
    pod = workload["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    for name, path, kind in ASCEND_HOST_PATHS:
        pod["volumes"].append(host_path(name, path, kind))
        agent["volumeMounts"].append(mount(name, path))
    agent["env"] += [
        {"name": "KEPLER_BRIDGE_NPU_SMI", "value": NPU_SMI},
        {"name": "LD_LIBRARY_PATH", "value": ASCEND_LIBRARY_PATH},
    ]
    return workload


BAETYL_LABELS = {"baetyl-service-name": "baetyl-accelerator-metrics"}


def baetyl_deployment(hardened: bool) -> dict[str, Any]:
    """One agent on a single-node edge box, as baetyl-core expects it."""
    selector = labels("kepler-bridge-baetyl", component=True) | BAETYL_LABELS
    spec = {"tolerations": [{"operator": "Exists"}], **pod_spec(hardened, "apiserver")}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta("kepler-bridge", BAETYL_NAMESPACE, "kepler-bridge-baetyl")
        | {"labels": selector | {"variant": variant(hardened)}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            # Never two agents at once on a small box: stop the old one, then start the new one.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": template(selector | {"variant": variant(hardened)}, spec),
        },
    }


def documents(*objects: dict[str, Any] | list[dict[str, Any]]) -> str:
    """Objects as one multi-document YAML file."""
    flat: list[dict[str, Any]] = []
    for item in objects:
        flat.extend(item if isinstance(item, list) else [item])
    return HEADER + "---\n".join(yaml.safe_dump(obj, sort_keys=False, width=120) for obj in flat)


def rendered() -> dict[Path, str]:
    """Every generated manifest and the text it must hold."""
    return {
        **_kubernetes(HERE / "kubernetes"),
        **_ascend(HERE / "kubernetes" / "ascend"),
        **_kubeedge(HERE / "kubeedge"),
        **_baetyl(HERE / "baetyl"),
        **remote_write_outputs(
            HERE, documents, edge_scheduling(), GPU_NODE_SELECTOR, BAETYL_NAMESPACE
        ),
        HERE / "seccomp" / SECCOMP_PROFILE: (
            json.dumps(seccomp_profile(HARDENED_CAPABILITIES), indent=2) + "\n"
        ),
    }


def _namespace_files(folder: Path) -> dict[Path, str]:
    """The namespace and the service account, which kubernetes/ and kubeedge/ share."""
    return {
        folder / "00-namespace.yaml": documents(namespace()),
        folder / "10-serviceaccount.yaml": documents(service_account(NAMESPACE)),
    }


def _kubernetes(k8s: Path) -> dict[Path, str]:
    """The cluster's DaemonSets (privileged and hardened) with RBAC, Service, NetworkPolicy and
    ServiceMonitor."""
    outputs = _namespace_files(k8s)
    outputs[k8s / "20-rbac.yaml"] = documents(rbac(NAMESPACE, "kepler-bridge"))
    for hardened in (False, True):
        sub = "hardened/" if hardened else ""
        outputs[k8s / f"{sub}30-daemonset.yaml"] = documents(
            daemonset(
                "kepler-bridge",
                NAMESPACE,
                "kepler-bridge",
                hardened,
                scheduling=cloud_scheduling(ASCEND_NODE_LABEL),
            )
        )
    outputs[k8s / "40-service.yaml"] = documents(service("kepler-bridge", "kepler-bridge"))
    outputs[k8s / "50-networkpolicy.yaml"] = documents(network_policy("kepler-bridge"))
    outputs[k8s / "60-servicemonitor.yaml"] = documents(
        service_monitor("kepler-bridge", "kepler-bridge")
    )
    return outputs


def _ascend(ascend: Path) -> dict[Path, str]:
    """The DaemonSet for Huawei Ascend nodes, with the host's driver and npu-smi mounted."""
    workload = daemonset(
        "kepler-bridge-ascend",
        NAMESPACE,
        "kepler-bridge-ascend",
        False,
        node_selector={"kubernetes.io/os": "linux", ASCEND_NODE_LABEL: "true"},
        scheduling=cloud_scheduling(),
    )
    return {
        ascend / "30-daemonset.yaml": documents(with_ascend(workload)),
        ascend / "40-service.yaml": documents(
            service("kepler-bridge-ascend", "kepler-bridge-ascend")
        ),
        ascend / "50-networkpolicy.yaml": documents(network_policy("kepler-bridge-ascend")),
        ascend / "60-servicemonitor.yaml": documents(
            service_monitor("kepler-bridge-ascend", "kepler-bridge-ascend")
        ),
    }


def _kubeedge(edge: Path) -> dict[Path, str]:
    """The DaemonSets for KubeEdge edge nodes. Edge pods read pod names from edgecore's
    MetaServer, so kubeedge/ grants nothing."""
    outputs = _namespace_files(edge)
    for hardened in (False, True):
        sub = "hardened/" if hardened else ""
        workload = daemonset(
            "kepler-bridge-edge",
            NAMESPACE,
            "kepler-bridge-edge",
            hardened,
            kube_source="metaserver",
            edge=True,
            scheduling=edge_scheduling(),
        )
        outputs[edge / f"{sub}30-daemonset.yaml"] = edge_daemonset(workload, hardened, documents)
    outputs[edge / "40-service.yaml"] = documents(
        service("kepler-bridge-edge", "kepler-bridge-edge")
    )
    outputs[edge / "60-servicemonitor.yaml"] = documents(
        service_monitor("kepler-bridge-edge", "kepler-bridge-edge")
    )
    return outputs


def _baetyl(baetyl: Path) -> dict[Path, str]:
    """Baetyl's cluster DaemonSets and single-node Deployments, each with its account and RBAC."""
    outputs: dict[Path, str] = {}
    for hardened in (False, True):
        sub = "hardened/" if hardened else ""
        outputs[baetyl / "cluster" / f"{sub}30-daemonset.yaml"] = documents(
            daemonset(
                "kepler-bridge",
                BAETYL_NAMESPACE,
                "kepler-bridge-baetyl",
                hardened,
                pod_labels=BAETYL_LABELS,
                scheduling={"tolerations": [{"operator": "Exists"}]},
            )
        )
        outputs[baetyl / "single-node" / f"{sub}30-deployment.yaml"] = documents(
            baetyl_deployment(hardened)
        )
    for folder in ("cluster", "single-node"):
        outputs[baetyl / folder / "10-serviceaccount.yaml"] = documents(
            service_account(BAETYL_NAMESPACE)
        )
        outputs[baetyl / folder / "20-rbac.yaml"] = documents(
            rbac(BAETYL_NAMESPACE, "kepler-bridge-baetyl")
        )
    return outputs
