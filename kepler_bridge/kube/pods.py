"""Container id -> (namespace, pod, container) from a v1 PodList (kubelet, API server and MetaServer alike)."""

from __future__ import annotations

from typing import Any

from kepler_bridge.model import PodRef

STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")


def containers_of(pod_list: Any) -> dict[str, PodRef]:
    """Every container of the list by its runtime id (``containerd://<id>`` -> ``<id>``, as cgroup paths name it)."""
    if not isinstance(pod_list, dict) or not isinstance(pod_list.get("items", []), list):
        raise ValueError("not a PodList: expected a JSON object with an items list")
    found: dict[str, PodRef] = {}
    for pod in pod_list.get("items") or []:
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        for kind in STATUS_LISTS:
            for container in status.get(kind) or []:
                container_id = str(container.get("containerID") or "").partition("://")[2]
                if container_id:
                    found[container_id] = PodRef(str(metadata.get("namespace", "")), str(metadata.get("name", "")),
                                                 str(container.get("name", "")))
    return found
