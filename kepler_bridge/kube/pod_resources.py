"""Which container the kubelet assigned each device to, from its pod-resources socket.

The socket answers v1.PodResourcesLister/List.

The message classes are built at import from a descriptor holding only the
fields read here, with the kubelet's field numbers (k8s.io/kubelet
pkg/apis/podresources/v1/api.proto); protobuf skips the others (cpu_ids,
memory, topology, dynamic_resources).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from kepler_bridge.kube.client import KubeError, too_large, too_slow
from kepler_bridge.kube.view import Assignment
from kepler_bridge.model import PodRef
from kepler_bridge.printable import label_text

LIST_METHOD = "/v1.PodResourcesLister/List"
# Far above the devices of any node, GPUs shared by time-slicing replicas included.
MAX_DEVICE_IDS = 16_384

_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED

# message -> fields as (name, number, type, label, message type)
_SCHEMA: dict[str, tuple[tuple[str, int, int, int, str], ...]] = {
    "ListPodResourcesRequest": (),
    "ListPodResourcesResponse": (("pod_resources", 1, _MESSAGE, _REPEATED, ".v1.PodResources"),),
    "PodResources": (
        ("name", 1, _STRING, _OPTIONAL, ""),
        ("namespace", 2, _STRING, _OPTIONAL, ""),
        ("containers", 3, _MESSAGE, _REPEATED, ".v1.ContainerResources"),
    ),
    "ContainerResources": (
        ("name", 1, _STRING, _OPTIONAL, ""),
        ("devices", 2, _MESSAGE, _REPEATED, ".v1.ContainerDevices"),
    ),
    "ContainerDevices": (
        ("resource_name", 1, _STRING, _OPTIONAL, ""),
        ("device_ids", 2, _STRING, _REPEATED, ""),
    ),
}


def _message_classes() -> dict[str, type[Message]]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="kepler_bridge/podresources_v1.proto", package="v1", syntax="proto3"
    )
    for message_name, fields in _SCHEMA.items():
        message = proto.message_type.add(name=message_name)
        for name, number, kind, label, type_name in fields:
            field = message.field.add(name=name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
    # A private pool: another library registering package v1 in the default pool cannot clash.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
        for name in _SCHEMA
    }


MESSAGES = _message_classes()


def list_assignments(socket_path: str, timeout: float, max_bytes: int) -> tuple[Assignment, ...]:
    """Every device of every container on this node, as the kubelet assigned them; the call
    takes `timeout` s at most in all, the reply `max_bytes` at most."""
    request_class, response_class = (
        MESSAGES["ListPodResourcesRequest"],
        MESSAGES["ListPodResourcesResponse"],
    )
    with grpc.insecure_channel(
        f"unix://{socket_path}", options=[("grpc.max_receive_message_length", max_bytes)]
    ) as channel:
        call = channel.unary_unary(
            LIST_METHOD,
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        try:
            response = call(request_class(), timeout=timeout)
        except grpc.RpcError as err:
            raise KubeError(
                f"pod-resources {socket_path}: {err.code().name}: {err.details()}; "
                f"{_advice(err.code(), timeout, max_bytes)}"
            ) from None
    return _assignments(response, socket_path)


def _assignments(response: Any, socket_path: str) -> tuple[Assignment, ...]:
    """The reply's device ids with their container, its names made printable; more ids than
    MAX_DEVICE_IDS is a KubeError (an empty id, two bytes on the wire, cost some 160 in memory)."""
    found: list[Assignment] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            owner = PodRef(*map(label_text, (pod.namespace, pod.name, container.name)))
            for devices in container.devices:
                if len(found) + len(devices.device_ids) > MAX_DEVICE_IDS:
                    raise KubeError(
                        f"pod-resources {socket_path}: more than {MAX_DEVICE_IDS} device ids "
                        "assigned, no node has as many devices: a broken or hostile kubelet "
                        "socket; check what listens there"
                    )
                resource = label_text(devices.resource_name)
                found += (Assignment(i, resource, owner) for i in devices.device_ids if i)
    return tuple(found)


def _advice(code: grpc.StatusCode, timeout: float, max_bytes: int) -> str:
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return too_large(max_bytes)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return too_slow(timeout, "kubelet")
    return (
        "mount the kubelet's /var/lib/kubelet/pod-resources directory read-write and run the "
        "agent as root"
    )
