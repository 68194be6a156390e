"""The `/api/v1/history` JSON: the held samples as one column per device and field, for the live
page."""

from __future__ import annotations

import json
from collections.abc import Iterator

from kepler_bridge import __version__
from kepler_bridge.model import Snapshot
from kepler_bridge.store import FIELDS, MAX_SAMPLES, MAX_SECONDS, History, Sample


def render(history: History, snapshot: Snapshot) -> bytes:
    """The snapshot's sources, devices and pod energy, each device with its series over the held
    samples."""
    samples = [s for s in history.samples() if s.timestamp <= snapshot.timestamp]
    return json.dumps(
        {
            "node": snapshot.node,
            "version": __version__,
            "timestamp": snapshot.timestamp,
            "interval_seconds": snapshot.interval_seconds,
            "window_seconds": min(MAX_SECONDS, MAX_SAMPLES * snapshot.interval_seconds),
            "timestamps": [round(s.timestamp, 3) for s in samples],
            "sources": _sources(snapshot),
            "devices": _devices(samples, snapshot),
            "pods": _pods(snapshot),
        },
        separators=(",", ":"),
    ).encode()


def _sources(snapshot: Snapshot) -> list[dict[str, object]]:
    return [
        {
            "name": s.name,
            "up": s.up,
            "state": s.state,
            "error": s.error,
            "errors_total": s.errors_total,
        }
        for s in snapshot.sources
    ]


def _devices(samples: list[Sample], snapshot: Snapshot) -> list[dict[str, object]]:
    """The snapshot's devices, each with one series per field over the samples."""
    columns = _columns(samples, snapshot)
    found = {d.uuid: d for d in snapshot.anomalies.devices} if snapshot.anomalies else {}
    return [
        {
            "gpu": gpu.index,
            "uuid": gpu.uuid,
            "vendor": gpu.vendor,
            "model": gpu.model,
            "up": gpu.up,
            "error": gpu.error,
            "memory_total_bytes": gpu.memory_total_bytes,
            "power_limit_watts": gpu.power_limit_watts,
            "throttled": [reason for reason, active in gpu.throttled if active],
            "last_xid_timestamp": gpu.last_xid_timestamp,
            "last_xid_code": gpu.last_xid_code,
            "series": {name: next(columns) for name in FIELDS},
            # The anomaly kinds firing now (gpu_anomaly) and the model's score; [] and None when
            # nothing fires or detection is off.
            "anomalies": list(found[gpu.uuid].firing) if gpu.uuid in found else [],
            "anomaly_score": found[gpu.uuid].score if gpu.uuid in found else None,
        }
        for gpu in snapshot.gpus
    ]


def _columns(samples: list[Sample], snapshot: Snapshot) -> Iterator[tuple[float | None, ...]]:
    """One column per device of the snapshot and field, in that order; None where a sample has
    no value."""
    picks = {uuids: _picks(uuids, snapshot) for uuids in {s.uuids for s in samples}}
    # One row per sample with FIELDS per device of the snapshot, then transposed into one column
    # per series.
    rows = [
        [None if i < 0 or (v := s.values[i]) != v else v for i in picks[s.uuids]] for s in samples
    ]
    return iter(zip(*rows) if rows else [()] * (len(snapshot.gpus) * len(FIELDS)))


def _pods(snapshot: Snapshot) -> list[dict[str, object]]:
    """The pods' energy, the largest first."""
    pods = sorted(snapshot.energy.pods, key=lambda p: p.cpu_joules + p.gpu_joules, reverse=True)
    return [
        {
            "namespace": p.owner.namespace,
            "pod": p.owner.pod,
            "cpu_joules": round(p.cpu_joules, 3),
            "gpu_joules": round(p.gpu_joules, 3),
        }
        for p in pods
    ]


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
