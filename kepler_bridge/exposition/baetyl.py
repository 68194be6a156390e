"""The /v1/collect JSON that baetyl-core reads (docs/design.md, "/v1/collect")."""

from __future__ import annotations

import json

from kepler_bridge.model import GpuReading, Snapshot

_UNIT_BYTES = {"bytes": 1, "KiB": 1024, "MiB": 1024 * 1024}


def _ratio(used: int, total: int) -> float:
    return used / total if total > 0 else 0


def _memory(gpu: GpuReading, divisor: int) -> tuple[int, int]:
    """(used, total) in the unit; used is 0 (unreadable) without a total it fits in."""
    total = gpu.memory_total_bytes if gpu.up else None
    if not total:
        return 0, 0
    used = gpu.memory_used_bytes
    if used is None or used > total:
        return 0, total // divisor
    return used // divisor, total // divisor


def render(snapshot: Snapshot, unit: str = "bytes") -> bytes:
    """One JSON object keyed by node name; every accelerator in index order, unreadable values 0.
    The node's values are the sums of its devices' as shown.

    The metric allow/deny lists never apply here: baetyl-core always gets the whole contract.
    """
    divisor = _UNIT_BYTES[unit]
    devices = []
    used_sum = total_sum = 0
    for gpu in snapshot.gpus:
        used, total = _memory(gpu, divisor)
        used_sum, total_sum = used_sum + used, total_sum + total
        devices.append({"usedMemory": used, "totalMemory": total, "percent": _ratio(used, total)})
    body = {
        snapshot.node: {
            "deviceNum": len(devices),
            "devices": devices,
            "usedMemory": used_sum,
            "totalMemory": total_sum,
            "percent": _ratio(used_sum, total_sum),
        }
    }
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
