"""The `/api/v1/history` JSON: the held samples as one column per device and field, for the live
page."""

from __future__ import annotations

import json

from kepler_bridge import __version__
from kepler_bridge.model import Snapshot
from kepler_bridge.store import FIELDS, MAX_SAMPLES, MAX_SECONDS, History


def render(history: History, snapshot: Snapshot) -> bytes:
    """The snapshot's sources, devices and pod energy, each device with its series over the held samples."""
    samples = [s for s in history.samples() if s.timestamp <= snapshot.timestamp]
    picks = {uuids: _picks(uuids, snapshot) for uuids in {s.uuids for s in samples}}
    # One row per sample with FIELDS per device of the snapshot, then transposed into one column per series.
    rows = [
        [None if i < 0 or (v := s.values[i]) != v else v for i in picks[s.uuids]] for s in samples
    ]
    columns = iter(zip(*rows) if rows else [()] * (len(snapshot.gpus) * len(FIELDS)))
    devices = [
        {
            "gpu": gpu.index,
            "uuid": gpu.uuid,
            "vendor": gpu.vendor,
            "model": gpu.model,
            "up": gpu.up,
            "error": gpu.error,
            "memory_total_bytes": gpu.memory_total_bytes,
            "power_limit_watts": gpu.power_limit_watts,
            "series": {name: next(columns) for name in FIELDS},
        }
        for gpu in snapshot.gpus
    ]
    pods = sorted(snapshot.energy.pods, key=lambda p: p.cpu_joules + p.gpu_joules, reverse=True)
    return json.dumps(
        {
            "node": snapshot.node,
            "version": __version__,
            "timestamp": snapshot.timestamp,
            "interval_seconds": snapshot.interval_seconds,
            "window_seconds": min(MAX_SECONDS, MAX_SAMPLES * snapshot.interval_seconds),
            "timestamps": [round(s.timestamp, 3) for s in samples],
            "sources": [
                {
                    "name": s.name,
                    "up": s.up,
                    "state": s.state,
                    "error": s.error,
                    "errors_total": s.errors_total,
                }
                for s in snapshot.sources
            ],
            "devices": devices,
            "pods": [
                {
                    "namespace": p.owner.namespace,
                    "pod": p.owner.pod,
                    "cpu_joules": round(p.cpu_joules, 3),
                    "gpu_joules": round(p.gpu_joules, 3),
                }
                for p in pods
            ],
        },
        separators=(",", ":"),
    ).encode()


def _picks(uuids: tuple[str, ...], snapshot: Snapshot) -> list[int]:
    """Where each of the snapshot's devices' FIELDS sit in a sample of devices `uuids`; -1 where
    absent."""
    where = _positions(uuids)
    return [
        where[key] * len(FIELDS) + offset if key in where else -1
        for key in _positions(tuple(gpu.uuid for gpu in snapshot.gpus))
        for offset in range(len(FIELDS))
    ]


def _positions(uuids: tuple[str, ...]) -> dict[tuple[str, int], int]:
    """(uuid, how many devices before had it) -> index: two sources reporting one device stay two
    series."""
    seen: dict[str, int] = {}
    positions = {}
    for index, uuid in enumerate(uuids):
        seen[uuid] = seen.get(uuid, -1) + 1
        positions[(uuid, seen[uuid])] = index
    return positions
