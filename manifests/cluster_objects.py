"""The Kubernetes objects around the agent's pods: labels and metadata, the namespace, the
service account and its RBAC, the Service, NetworkPolicy and ServiceMonitor."""

from __future__ import annotations

from typing import Any

PORT = 30060
NAMESPACE = "kepler-bridge"


def labels(instance: str, component: bool = False) -> dict[str, str]:
    """Recommended labels; `component` marks the agent pods themselves."""
    result = {
        "app.kubernetes.io/name": "kepler-bridge",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/part-of": "kepler-bridge",
    }
    if component:
        result["app.kubernetes.io/component"] = "agent"
    return result


def meta(name: str, namespace: str | None, instance: str, **extra: Any) -> dict[str, Any]:
    """Object metadata."""
    result: dict[str, Any] = {"name": name}
    if namespace:
        result["namespace"] = namespace
    result["labels"] = labels(instance)
    result.update(extra)
    return result


def namespace() -> dict[str, Any]:
    """The agent's namespace; hostPID and hostPath volumes need the privileged Pod Security
    level."""
    policy = {
        f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")
    }
    policy["pod-security.kubernetes.io/enforce-version"] = "latest"
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": labels("kepler-bridge") | policy},
    }


def service_account(ns: str) -> dict[str, Any]:
    """The agent's identity; its token is mounted only into pods that ask for it."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta("kepler-bridge", ns, "kepler-bridge"),
        "automountServiceAccountToken": False,
    }


def rbac(ns: str, binding: str) -> list[dict[str, Any]]:
    """Read-only access to pods: the agent names the namespace/pod/container of each process."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": meta("kepler-bridge", None, "kepler-bridge"),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }
    bind = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": meta(binding, None, "kepler-bridge"),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "kepler-bridge",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "kepler-bridge", "namespace": ns}],
    }
    return [role, bind]


def service(name: str, instance: str) -> dict[str, Any]:
    """A headless Service: one endpoint per agent pod, for ServiceMonitors and annotation-based
    scraping."""
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, NAMESPACE, instance, annotations=annotations),
        "spec": {
            "clusterIP": "None",
            "selector": labels(instance, component=True),
            "ports": [
                {"name": "metrics", "port": PORT, "targetPort": "metrics", "protocol": "TCP"}
            ],
        },
    }


def network_policy(instance: str) -> dict[str, Any]:
    """Ingress to the agent pods on the metrics port only; nothing else reaches them."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(instance, NAMESPACE, instance),
        "spec": {
            "podSelector": {"matchLabels": labels(instance, component=True)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"port": PORT, "protocol": "TCP"}]}],
        },
    }


def service_monitor(name: str, instance: str) -> dict[str, Any]:
    """prometheus-operator scrape config; the job label is the Service's name (matched by the
    alerts). The agent's own namespace, pod and container labels name the workload, not the
    agent: the operator's target labels of those names must not replace them."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": labels(instance) | {"release": "kube-prometheus-stack"},
        },
        "spec": {
            "selector": {"matchLabels": labels(instance)},
            "namespaceSelector": {"matchNames": [NAMESPACE]},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": "15s",
                    "scrapeTimeout": "10s",
                    "honorLabels": True,
                }
            ],
        },
    }
