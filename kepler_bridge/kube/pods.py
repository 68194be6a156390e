"""Container id -> (namespace, pod, container) from a v1 PodList (kubelet, API server and
MetaServer alike)."""

from __future__ import annotations

from typing import Any

from kepler_bridge.model import PodRef

STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}


def containers_of(pod_list: Any) -> dict[str, PodRef]:
    """Every container of the list by its runtime id (``containerd://<id>`` -> ``<id>``, as
    cgroup paths name it).

    Anything shaped unlike a PodList (null where an object, list or string belongs) is a
    ValueError: the endpoint that sent it is broken, and the next one is asked.
    """
    if not isinstance(pod_list, dict):
        raise ValueError("not a PodList: expected a JSON object with an items list")
    found: dict[str, PodRef] = {}
    for pod in _field(pod_list, "items", list, "PodList"):
        pod = _checked(pod, dict, "items[]")
        metadata, status = _field(pod, "metadata", dict, "pod"), _field(pod, "status", dict, "pod")
        namespace, name = (
            _field(metadata, "namespace", str, "metadata"),
            _field(metadata, "name", str, "metadata"),
        )
        for kind in STATUS_LISTS:
            for container in _field(status, kind, list, "status"):
                container = _checked(container, dict, f"status.{kind}[]")
                container_id = _field(container, "containerID", str, kind).partition("://")[2]
                if container_id:
                    found[container_id] = PodRef(
                        namespace, name, _field(container, "name", str, kind)
                    )
    return found


def _field(parent: dict, key: str, kind: type, where: str) -> Any:
    """parent[key] when it has the JSON type kind; an empty one when absent (Kubernetes omits
    empty fields)."""
    return _checked(parent.get(key, kind()), kind, f"{where}.{key}")


def _checked(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(
            f"not a PodList: {where} is {_JSON_NAMES[type(value)]}, expected {_JSON_NAMES[kind]}; "
            "check the endpoint's version and logs"
        )
    return value
