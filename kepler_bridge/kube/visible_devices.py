"""Which devices a container was given, from the environment its runtime set (where no kubelet
pod-resources socket says it, as on KubeEdge).

Read as the runtimes read them: ``NVIDIA_VISIBLE_DEVICES`` as the NVIDIA
container toolkit does (``all``; ``none``, ``void`` or empty: no device;
else uuids, ``MIG-`` uuids, NVML indexes or ``<gpu>:<mig>``),
``ASCEND_VISIBLE_DEVICES`` as Ascend's docker runtime does (ids and ranges,
``0-3,5``). ``CUDA_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` count only when they hold uuids: their indexes count
among the devices the container sees, not the node's, so they name nothing
here. CUDA uuids narrow what ``NVIDIA_VISIBLE_DEVICES`` gives (CUDA sees no
more than the runtime exposed), or stand alone where it gives nothing (a
privileged container that picks its GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from kepler_bridge.kube.view import device_key
from kepler_bridge.model import MAX_DEVICES, GpuReading

NAMES = (
    b"NVIDIA_VISIBLE_DEVICES",
    b"CUDA_VISIBLE_DEVICES",
    b"ASCEND_VISIBLE_DEVICES",
    b"ROCR_VISIBLE_DEVICES",
    b"HIP_VISIBLE_DEVICES",
)
# Longer tokens are no device name; more than MAX_DEVICES of them name no more devices.
MAX_TOKEN = 96
MAX_VALUE = MAX_TOKEN * MAX_DEVICES
_UUID = re.compile(r"^(?:GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/._:-]*$")
_INDEX = re.compile(r"^\d{1,3}$")
_MIG_INDEX = re.compile(r"^(\d{1,3}):(\d{1,3})$")
_ASCEND = re.compile(r"^(\d{1,3})(?:-(\d{1,3}))?$")
_ROCM_UUID = re.compile(r"^GPU-([0-9a-fA-F]{16})$")
_NOTHING = ("none", "void", "")


@dataclass(frozen=True)
class VisibleDevices:
    """The device variables of one environment, checked and bounded; read with `named`."""

    nvidia_all: bool = False
    nvidia: tuple[str, ...] = ()  # uuids, indexes and <gpu>:<mig>; () with nvidia_all False: none
    cuda: tuple[str, ...] = ()  # uuids only: () when unset or when it holds an index
    ascend: tuple[int, ...] = ()
    rocm: tuple[str, ...] = ()  # the 16 hex digits of each ROCm uuid

    def __bool__(self) -> bool:
        return bool(self.nvidia_all or self.nvidia or self.cuda or self.ascend or self.rocm)


NO_DEVICES = VisibleDevices()


def parse_environ(data: bytes) -> VisibleDevices:
    """The device variables of /proc/<pid>/environ's bytes (NUL-separated NAME=value); the first
    of a repeated name counts, as getenv finds it; bytes that are not UTF-8 name nothing."""
    found = {name: _value(data, name) for name in NAMES}
    nvidia = found[b"NVIDIA_VISIBLE_DEVICES"]
    return VisibleDevices(
        nvidia_all=nvidia is not None and nvidia.strip() == "all",
        nvidia=_nvidia(nvidia),
        cuda=_uuids_only(found[b"CUDA_VISIBLE_DEVICES"]),
        ascend=_ascend(found[b"ASCEND_VISIBLE_DEVICES"]),
        rocm=_rocm(found[b"ROCR_VISIBLE_DEVICES"], found[b"HIP_VISIBLE_DEVICES"]),
    )


def _value(data: bytes, name: bytes) -> str | None:
    """The value of the first entry `name`=..., found by bytes.find (a hostile environ, a million
    NULs, costs no list of its entries); past MAX_VALUE bytes it is cut after its last comma."""
    if data.startswith(name + b"="):
        start = len(name) + 1
    else:
        found = data.find(b"\0" + name + b"=")
        if found < 0:
            return None
        start = found + len(name) + 2
    limit = start + MAX_VALUE
    end = data.find(b"\0", start, limit + 1)
    if end >= 0 or len(data) <= limit:
        value = data[start : end if end >= 0 else len(data)]
    else:
        value = data[start:limit]
        value = value[: max(0, value.rfind(b","))]
    return value.decode("utf-8", "replace")


def _tokens(value: str | None) -> list[str]:
    if value is None:
        return []
    tokens = (token.strip() for token in value.split(",")[:MAX_DEVICES])
    return [token for token in tokens if 0 < len(token) <= MAX_TOKEN]


def _nvidia(value: str | None) -> tuple[str, ...]:
    if value is None or value.strip() in ("all", *_NOTHING):
        return ()
    return tuple(
        token
        for token in _tokens(value)
        if _UUID.match(token) or _INDEX.match(token) or _MIG_INDEX.match(token)
    )


def _uuids_only(value: str | None) -> tuple[str, ...]:
    tokens = _tokens(value)
    if not all(_UUID.match(token) for token in tokens):
        return ()
    return tuple(tokens)


def _ascend(value: str | None) -> tuple[int, ...]:
    ids: dict[int, None] = {}
    for token in _tokens(value):
        match = _ASCEND.match(token)
        if match:
            first = int(match.group(1))
            last = int(match.group(2) or first)
            ids.update(dict.fromkeys(range(first, min(last, first + MAX_DEVICES) + 1)))
    return tuple(ids)[:MAX_DEVICES]


def _rocm(*values: str | None) -> tuple[str, ...]:
    found: dict[str, None] = {}
    for value in values:
        for token in _tokens(value):
            match = _ROCM_UUID.match(token)
            if match:
                found[match.group(1).lower()] = None
    return tuple(found)


def named(visible: VisibleDevices, gpus: Sequence[GpuReading]) -> tuple[frozenset[str], bool]:
    """The device keys (`device_key`) of the GPUs and MIG devices among `gpus` (as their sources
    list them, with their own indexes) that these variables give, and whether they were given by
    `all` rather than by name."""
    nvidia = [gpu for gpu in gpus if gpu.vendor == "nvidia"]
    keys: set[str] = set()
    if visible.nvidia_all:
        keys.update(device_key(gpu.uuid) for gpu in nvidia)
    for token in visible.nvidia:
        keys.update(_nvidia_keys(token, nvidia))
    if visible.cuda:
        cuda = {device_key(token) for token in visible.cuda}
        keys = _narrowed(keys, cuda, nvidia) if keys else cuda
    keys.update(_ascend_keys(visible.ascend, gpus))
    keys.update(f"amd-{hex_digits}" for hex_digits in visible.rocm)
    return frozenset(keys), visible.nvidia_all and not visible.cuda


def _nvidia_keys(token: str, nvidia: Iterable[GpuReading]) -> list[str]:
    if _UUID.match(token):
        return [device_key(token)]
    mig = _MIG_INDEX.match(token)
    position = int(mig.group(1) if mig else token)
    keys = []
    for gpu in nvidia:
        if gpu.index != position:
            continue
        if mig is None:
            keys.append(device_key(gpu.uuid))
        elif int(mig.group(2)) < len(gpu.mig_instances):
            keys.append(device_key(gpu.mig_instances[int(mig.group(2))].uuid))
    return keys


def _narrowed(keys: set[str], cuda: set[str], nvidia: Iterable[GpuReading]) -> set[str]:
    """The CUDA uuids among what the runtime gave: a MIG device counts where its GPU was given."""
    parents = {device_key(uuid): device_key(gpu.uuid) for gpu in nvidia for uuid in gpu.mig_uuids}
    return {key for key in cuda if key in keys or parents.get(key) in keys}


def _ascend_keys(ids: tuple[int, ...], gpus: Iterable[GpuReading]) -> list[str]:
    """The chips with these device ids: the id Ascend's device plugin puts after the family
    (Ascend910-3 is id 3)."""
    if not ids:
        return []
    wanted = {str(number) for number in ids}
    return [
        device_key(gpu.uuid)
        for gpu in gpus
        if gpu.vendor == "huawei"
        and any(name.rsplit("-", 1)[-1] in wanted for name in gpu.device_ids)
    ]
