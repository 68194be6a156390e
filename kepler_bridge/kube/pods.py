"""Container id -> (namespace, pod, container) from a v1 PodList (kubelet, API server and
MetaServer alike)."""

from __future__ import annotations

import json
from typing import Any, Iterator

from kepler_bridge.model import PodRef
from kepler_bridge.printable import label_text

STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
# Every key containers_of reads; parsing keeps no other.
READ_KEYS = frozenset(("items", "metadata", "status", "namespace", "name", "containerID", "phase"))
# Pods whose containers all ended for good: pod-resources may still list their devices (fixed only
# in Kubernetes 1.35, kubernetes#119423), which a new pod holds now.
FINISHED_PHASES = frozenset(("Succeeded", "Failed"))
READ_KEYS |= frozenset(STATUS_LISTS)
# A pod list has one JSON value per 15 bytes or more (managedFields are the densest part). Parsed,
# a value costs up to ~150 bytes (small objects of kept keys; nested empty lists cost ~30 bytes per
# byte of reply): one value per BYTES_PER_VALUE bytes of the size limit keeps parsing under 10x it.
BYTES_PER_VALUE = 16
_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}


def read_pod_list(body: bytes | bytearray, max_bytes: int) -> Any:
    """The JSON of a reply with only the keys containers_of reads, so a pod list costs about its
    own size once parsed; ValueError when it is not JSON or holds more values than a pod list
    within `max_bytes` may."""
    # Every value but the first follows a comma or opens a container; commas in strings count
    # too, erring on the safe side.
    values = body.count(b",") + body.count(b"[") + body.count(b"{")
    if values > max_bytes // BYTES_PER_VALUE:
        raise ValueError(
            f"not a PodList: more JSON values than one per {BYTES_PER_VALUE} bytes of "
            f"kube_max_reply_bytes ({max_bytes}); raise kube_max_reply_bytes if it is one"
        )
    return json.loads(body, object_pairs_hook=_read_keys)


def _read_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: value for key, value in pairs if key in READ_KEYS}


def containers_of(pod_list: Any) -> dict[str, PodRef]:
    """Every container of the list by its runtime id (``containerd://<id>`` -> ``<id>``, as
    cgroup paths name it).

    Anything shaped unlike a PodList (null where an object, list or string belongs) is a
    ValueError: the endpoint that sent it is broken, and the next one is asked.
    """
    found: dict[str, PodRef] = {}
    for namespace, name, status in _pods(pod_list):
        for kind in STATUS_LISTS:
            for container in _field(status, kind, list, "status"):
                container = _checked(container, dict, f"status.{kind}[]")
                container_id = _field(container, "containerID", str, kind).partition("://")[2]
                if container_id:
                    found[container_id] = PodRef(
                        namespace, name, label_text(_field(container, "name", str, kind))
                    )
    return found


def finished_pods(pod_list: Any) -> frozenset[tuple[str, str]]:
    """(namespace, name) of the list's pods in phase Succeeded or Failed; ValueError as
    `containers_of`."""
    return frozenset(
        (namespace, name)
        for namespace, name, status in _pods(pod_list)
        if _field(status, "phase", str, "status") in FINISHED_PHASES
    )


def _pods(pod_list: Any) -> Iterator[tuple[str, str, dict]]:
    """Each pod's namespace, name and status; ValueError where the list is shaped unlike one."""
    if not isinstance(pod_list, dict):
        raise ValueError("not a PodList: expected a JSON object with an items list")
    for pod in _field(pod_list, "items", list, "PodList"):
        pod = _checked(pod, dict, "items[]")
        metadata, status = _field(pod, "metadata", dict, "pod"), _field(pod, "status", dict, "pod")
        namespace = label_text(_field(metadata, "namespace", str, "metadata"))
        yield namespace, label_text(_field(metadata, "name", str, "metadata")), status


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
