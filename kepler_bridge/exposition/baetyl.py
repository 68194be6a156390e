"""The /v1/collect JSON that baetyl-core reads (docs/design.md, "/v1/collect")."""

from __future__ import annotations

import json

from kepler_bridge.model import Snapshot

_UNIT_BYTES = {"bytes": 1, "KiB": 1024, "MiB": 1024 * 1024}


def _ratio(used: int, total: int) -> float:
    return min(1.0, used / total) if total > 0 else 0


def render(snapshot: Snapshot, unit: str = "bytes") -> bytes:
    """One JSON object keyed by node name; every accelerator in index order, unreadable values 0.

    The metric allow/deny lists never apply here: baetyl-core always gets the whole contract.
    """
    divisor = _UNIT_BYTES[unit]
    devices = []
    used_sum = total_sum = 0
    for gpu in snapshot.gpus:
        used = (gpu.memory_used_bytes or 0) if gpu.up else 0
        total = (gpu.memory_total_bytes or 0) if gpu.up else 0
        used_sum, total_sum = used_sum + used, total_sum + total
        devices.append(
            {
                "usedMemory": used // divisor,
                "totalMemory": total // divisor,
                "percent": _ratio(used, total),
            }
        )
    body = {
        snapshot.node: {
            "deviceNum": len(devices),
            "devices": devices,
            "usedMemory": used_sum // divisor,
            "totalMemory": total_sum // divisor,
            "percent": _ratio(used_sum, total_sum),
        }
    }
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
