"""The edge side of remote write: Prometheus in agent mode on every edge node, scraping the local
agent and sending to a cloud receiver through a write-ahead log that outlives outages
(manifests/README.md, "Remote write").

Its own workload beside the agent's, opt-in (a `remote-write/` subfolder): the receiver's URL and
credentials come from the Secret `kepler-bridge-remote-write`, which the operator creates.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import yaml

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from cluster_objects import NAMESPACE, PORT, labels, meta  # noqa: E402

# The version tests/test_remote_write.py runs (Debian bookworm's prometheus); the official image
# has busybox's sh, which renders the configuration in the init container.
PROMETHEUS_IMAGE = "quay.io/prometheus/prometheus:v2.42.0"
SECRET = "kepler-bridge-remote-write"
SCRAPE_INTERVAL = "15s"
JOB = "kepler-bridge-edge"
# The WAL keeps what the receiver has not acknowledged, but never samples older than MAX_TIME;
# agent mode truncates every 2 h, so it holds at most MAX_TIME + 2 h of samples, and twice that
# while a checkpoint is written. WAL_SIZE_LIMIT is sized from benchmarks/remote_write_bytes.py
# (manifests/README.md, "Remote write"): past the emptyDir's limit the kubelet would evict the
# pod, WAL and all.
MAX_TIME = "24h"
MIN_TIME = "5m"
TRUNCATE_HOURS = 2
WAL_SIZE_LIMIT = "512Mi"
WAL_MOUNT = "/prometheus"
SECRET_MOUNT = "/etc/kepler-bridge/remote-write"
TEMPLATE_MOUNT = "/etc/kepler-bridge/remote-write-template"
CONFIG_MOUNT = "/etc/prometheus"
LISTEN_PORT = 30061
UID = 65534
# Receivers take bursts after an outage well; a small box should not open 200 connections. A
# receiver answering 429 (Mimir, Cortex, Grafana Cloud, as a fleet sends its backlog after an
# outage) asks for a retry: without retry_on_http_429 Prometheus 2.x drops those samples.
QUEUE = {
    "capacity": 2500,
    "max_shards": 4,
    "max_samples_per_send": 2000,
    "retry_on_http_429": True,
}
# The benchmark's Prometheus agent: 52-55 MB resident, about 1 s of CPU a minute.
RESOURCES = {
    "requests": {"cpu": "20m", "memory": "64Mi"},
    "limits": {"cpu": "500m", "memory": "256Mi"},
}
# Go's soft memory limit, under the container's, so that the collector works before the OOM
# killer does.
GOMEMLIMIT = "200MiB"


class Block(str):
    """Text that the YAML files show as a literal block, as it is, not as one quoted line."""


yaml.SafeDumper.add_representer(
    Block, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|")
)

# Appends the remote_write entry's URL, credentials and TLS files from the Secret to the template
# (whose last key is that entry) and puts the node's name in the labels. POSIX sh: busybox's in
# the image, dash in the tests.
RENDER_SCRIPT = Block(r"""set -eu
fail() { echo "remote-write: $*" >&2; exit 1; }
secret=$REMOTE_WRITE_SECRET_DIR
[ -s "$secret/url" ] ||
  fail "Secret $REMOTE_WRITE_SECRET has no key url: see manifests/README.md, Remote write"
url=$(cat "$secret/url")
case "$url" in
  https://*) ;;
  *) fail "url must start with https:// (credentials go with every request): ${url%%//*}//...";;
esac
case "$url" in *[\"\\\ ]*) fail "url holds a quote, backslash or space: percent-encode it";; esac
authority=${url#https://}
case "${authority%%/*}" in
  *@*) fail "url holds a user or password (Prometheus logs it): use keys username, password";;
esac
out=$PROMETHEUS_CONFIG.tmp
sed "s/@NODE_NAME@/$KUBE_NODE_NAME/g" "$REMOTE_WRITE_TEMPLATE" > "$out"
printf '  url: "%s"\n' "$url" >> "$out"
if [ -s "$secret/token" ]; then
  printf '  authorization:\n    credentials_file: %s/token\n' "$secret" >> "$out"
elif [ -s "$secret/username" ] && [ -s "$secret/password" ]; then
  user=$(cat "$secret/username")
  case "$user" in *[\"\\]*) fail "username holds a quote or backslash";; esac
  printf '  basic_auth:\n    username: "%s"\n' "$user" >> "$out"
  printf '    password_file: %s/password\n' "$secret" >> "$out"
else
  fail "Secret $REMOTE_WRITE_SECRET needs key token, or keys username and password"
fi
if [ -s "$secret/tenant" ]; then
  tenant=$(cat "$secret/tenant")
  case "$tenant" in *[\"\\]*) fail "tenant holds a quote or backslash";; esac
  printf '  headers:\n    X-Scope-OrgID: "%s"\n' "$tenant" >> "$out"
fi
printf '  tls_config:\n' >> "$out"
[ -s "$secret/ca.crt" ] && printf '    ca_file: %s/ca.crt\n' "$secret" >> "$out"
if [ -s "$secret/tls.crt" ] && [ -s "$secret/tls.key" ]; then
  printf '    cert_file: %s/tls.crt\n    key_file: %s/tls.key\n' "$secret" "$secret" >> "$out"
fi
printf '    insecure_skip_verify: false\n' >> "$out"
mv "$out" "$PROMETHEUS_CONFIG"
""")


def prometheus_config(target: str) -> dict[str, Any]:
    """The agent-mode configuration; the remote_write entry is completed by RENDER_SCRIPT."""
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": "10s",
            "external_labels": {"node": "@NODE_NAME@"},
        },
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [{"targets": [target]}],
                # One instance per node at the cloud, not 127.0.0.1 a thousand times.
                "relabel_configs": [{"target_label": "instance", "replacement": "@NODE_NAME@"}],
            }
        ],
        "remote_write": [
            {
                "name": "cloud",
                "remote_timeout": "30s",
                "queue_config": QUEUE,
                "metadata_config": {"send": True, "send_interval": "1m"},
            }
        ],
    }


def prometheus_args(listen: str, wal: str, config: str) -> list[str]:
    """Prometheus' flags: agent mode, the WAL compressed and bounded by age."""
    return [
        "--enable-feature=agent",
        f"--config.file={config}",
        f"--storage.agent.path={wal}",
        "--storage.agent.wal-compression",
        f"--storage.agent.retention.max-time={MAX_TIME}",
        f"--storage.agent.retention.min-time={MIN_TIME}",
        f"--web.listen-address={listen}",
    ]


def render_env(secret_dir: str, template: str, config: str, node: dict[str, Any]) -> list[dict]:
    """The variables RENDER_SCRIPT reads; `node` is the KUBE_NODE_NAME entry."""
    return [
        {"name": "REMOTE_WRITE_SECRET", "value": SECRET},
        {"name": "REMOTE_WRITE_SECRET_DIR", "value": secret_dir},
        {"name": "REMOTE_WRITE_TEMPLATE", "value": template},
        {"name": "PROMETHEUS_CONFIG", "value": config},
        {"name": "KUBE_NODE_NAME", **node},
    ]


def _security() -> dict[str, Any]:
    """Nobody, read-only root, no capabilities: Prometheus needs nothing of the host."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "capabilities": {"drop": ["ALL"]},
    }


def _probe(path: str, host_network: bool) -> dict[str, Any]:
    get: dict[str, Any] = {"path": path, "port": LISTEN_PORT}
    if host_network:
        get["host"] = "127.0.0.1"
    return {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}


def _containers(host_network: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The init container that renders the configuration, and Prometheus."""
    config = f"{CONFIG_MOUNT}/prometheus.yml"
    node = {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}}
    secret_mount = {"name": "secret", "mountPath": SECRET_MOUNT, "readOnly": True}
    config_mount = {"name": "config", "mountPath": CONFIG_MOUNT}
    render = {
        "name": "render-config",
        "image": PROMETHEUS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c", RENDER_SCRIPT],
        "env": render_env(SECRET_MOUNT, f"{TEMPLATE_MOUNT}/prometheus.yml", config, node),
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}},
        "securityContext": _security(),
        "volumeMounts": [
            secret_mount,
            {"name": "template", "mountPath": TEMPLATE_MOUNT, "readOnly": True},
            config_mount,
        ],
    }
    listen = f"127.0.0.1:{LISTEN_PORT}" if host_network else f":{LISTEN_PORT}"
    prometheus = {
        "name": "prometheus",
        "image": PROMETHEUS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": prometheus_args(listen, f"{WAL_MOUNT}/agent", config),
        "env": [{"name": "GOMEMLIMIT", "value": GOMEMLIMIT}],
        "livenessProbe": _probe("/-/healthy", host_network),
        "readinessProbe": _probe("/-/ready", host_network),
        "resources": RESOURCES,
        "securityContext": _security(),
        "volumeMounts": [
            dict(secret_mount),
            {**config_mount, "readOnly": True},
            {"name": "wal", "mountPath": WAL_MOUNT},
        ],
    }
    return render, prometheus


def pod_spec(host_network: bool, scheduling: dict[str, Any]) -> dict[str, Any]:
    """The remote-write pod: no token, no host access; the WAL on a bounded disk volume."""
    render, prometheus = _containers(host_network)
    spec: dict[str, Any] = {
        **scheduling,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
        # Time to flush what is queued when the pod stops.
        "terminationGracePeriodSeconds": 60,
    }
    if host_network:
        # The receiver is a cloud name: the node's resolver finds it where an edge node has no
        # cluster DNS.
        spec |= {"hostNetwork": True, "dnsPolicy": "Default"}
    spec["initContainers"] = [render]
    spec["containers"] = [prometheus]
    spec["volumes"] = [
        {"name": "secret", "secret": {"secretName": SECRET, "defaultMode": 0o440}},
        {"name": "template", "configMap": {"name": "kepler-bridge-remote-write"}},
        {"name": "config", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        # On disk, not in memory: it survives a restart of the container, and of the node where
        # the kubelet keeps the pod (edge autonomy).
        {"name": "wal", "emptyDir": {"sizeLimit": WAL_SIZE_LIMIT}},
    ]
    return spec


def config_map(ns: str, target: str) -> dict[str, Any]:
    """The configuration template that the init container completes from the Secret."""
    text = yaml.safe_dump(prometheus_config(target), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("kepler-bridge-remote-write", ns, "kepler-bridge-remote-write"),
        "data": {"prometheus.yml": Block(text)},
    }


def workload(kind: str, ns: str, host_network: bool, scheduling: dict[str, Any]) -> dict[str, Any]:
    """One Prometheus agent per node beside the agent (DaemonSet), or on a single box
    (Deployment)."""
    selector = labels("kepler-bridge-remote-write") | {
        "app.kubernetes.io/component": "remote-write"
    }
    spec: dict[str, Any] = {"selector": {"matchLabels": selector}}
    if kind == "Deployment":
        # Never two writers of the same series on one box: stop the old pod first.
        spec |= {"replicas": 1, "strategy": {"type": "Recreate"}}
    else:
        spec["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    spec["template"] = {
        "metadata": {"labels": dict(selector)},
        "spec": pod_spec(host_network, scheduling),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": meta("kepler-bridge-remote-write", ns, "kepler-bridge-remote-write")
        | {"labels": dict(selector)},
        "spec": spec,
    }


def local_service(ns: str, instance: str) -> dict[str, Any]:
    """The agent of this node only (internalTrafficPolicy Local), for pods off the host network."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta("kepler-bridge-local", ns, instance),
        "spec": {
            "selector": labels(instance, component=True),
            "internalTrafficPolicy": "Local",
            "ports": [
                {"name": "metrics", "port": PORT, "targetPort": "metrics", "protocol": "TCP"}
            ],
        },
    }


def outputs(
    here: Path,
    documents: Callable[..., str],
    edge: dict[str, Any],
    gpu_nodes: dict[str, str],
    baetyl_ns: str,
) -> dict[Path, str]:
    """The `remote-write/` subfolders of kubeedge/ and baetyl/: `edge` is the KubeEdge
    scheduling, `gpu_nodes` the nodeSelector of the agent's DaemonSets, `baetyl_ns` baetyl's
    namespace."""
    files: dict[Path, str] = {}
    kubeedge = here / "kubeedge" / "remote-write"
    files[kubeedge / "10-configmap.yaml"] = documents(config_map(NAMESPACE, f"127.0.0.1:{PORT}"))
    files[kubeedge / "30-daemonset.yaml"] = documents(
        workload("DaemonSet", NAMESPACE, True, {"nodeSelector": gpu_nodes, **edge})
    )
    local = f"kepler-bridge-local.{baetyl_ns}.svc:{PORT}"
    for folder, kind, scheduling in (
        ("cluster", "DaemonSet", {"nodeSelector": gpu_nodes}),
        ("single-node", "Deployment", {}),
    ):
        baetyl = here / "baetyl" / folder / "remote-write"
        files[baetyl / "10-configmap.yaml"] = documents(config_map(baetyl_ns, local))
        tolerate = {**scheduling, "tolerations": [{"operator": "Exists"}]}
        files[baetyl / f"30-{kind.lower()}.yaml"] = documents(
            workload(kind, baetyl_ns, False, tolerate)
        )
        files[baetyl / "40-service.yaml"] = documents(
            local_service(baetyl_ns, "kepler-bridge-baetyl")
        )
    return files
