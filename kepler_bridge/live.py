"""The live page at `/` and the bounded history of samples it charts, served as `/api/v1/history` JSON."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from array import array
from importlib import resources
from typing import NamedTuple

from kepler_bridge import __version__
from kepler_bridge.model import GpuReading, Snapshot

MAX_SAMPLES = 300
MAX_SECONDS = 300.0
# What the page charts per device; a sample keeps these and nothing else.
FIELDS = ("utilization", "memory_used_bytes", "temperature_celsius", "power_watts")

_TEMPLATE = resources.files("kepler_bridge").joinpath("static/index.html").read_text("utf-8")


def _csp(template: str) -> str:
    """Allows exactly the page's own inline script and style (by hash) and requests to this agent."""
    hashes = {kind: "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
              for kind, body in re.findall(r"<(script|style)>(.*?)</\1>", template, re.DOTALL)}
    return (f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


CONTENT_SECURITY_POLICY = _csp(_TEMPLATE)


class _Sample(NamedTuple):
    """One snapshot summarised: FIELDS per device in `uuids` order, rounded, NaN where a device reported nothing."""

    timestamp: float
    uuids: tuple[str, ...]  # the previous sample's tuple when the devices did not change, so it is shared
    values: array


class History:
    """The newest samples, at most MAX_SAMPLES and MAX_SECONDS; one writer, readers never lock."""

    def __init__(self) -> None:
        self._samples: tuple[_Sample, ...] = ()

    def add(self, snapshot: Snapshot) -> None:
        """Append the snapshot's summary and drop what falls out of the window."""
        samples = self._samples
        uuids = tuple([gpu.uuid for gpu in snapshot.gpus])
        if samples and samples[-1].uuids == uuids:
            uuids = samples[-1].uuids
        values = array("d", [_value(gpu, name) for gpu in snapshot.gpus for name in FIELDS])
        oldest = snapshot.timestamp - MAX_SECONDS
        kept = tuple(s for s in samples[-(MAX_SAMPLES - 1):] if s.timestamp > oldest)
        self._samples = (*kept, _Sample(snapshot.timestamp, uuids, values))

    def samples(self) -> tuple[_Sample, ...]:
        """The samples held now, oldest first."""
        return self._samples


def _value(gpu: GpuReading, name: str) -> float:
    value = getattr(gpu, name) if gpu.up else None
    return math.nan if value is None else round(float(value), 3)


def history_json(history: History, snapshot: Snapshot) -> bytes:
    """The snapshot's sources, devices and pod energy, each device with its series over the held samples."""
    samples = [s for s in history.samples() if s.timestamp <= snapshot.timestamp]
    picks = {uuids: _picks(uuids, snapshot) for uuids in {s.uuids for s in samples}}
    # One row per sample with FIELDS per device of the snapshot, then transposed into one column per series.
    rows = [[None if i < 0 or (v := s.values[i]) != v else v for i in picks[s.uuids]] for s in samples]
    columns = iter(zip(*rows) if rows else [()] * (len(snapshot.gpus) * len(FIELDS)))
    devices = [{"gpu": gpu.index, "uuid": gpu.uuid, "vendor": gpu.vendor, "model": gpu.model, "up": gpu.up,
                "error": gpu.error, "memory_total_bytes": gpu.memory_total_bytes,
                "power_limit_watts": gpu.power_limit_watts,
                "series": {name: next(columns) for name in FIELDS}} for gpu in snapshot.gpus]
    pods = sorted(snapshot.energy.pods, key=lambda p: p.cpu_joules + p.gpu_joules, reverse=True)
    return json.dumps({
        "node": snapshot.node,
        "version": __version__,
        "timestamp": snapshot.timestamp,
        "interval_seconds": snapshot.interval_seconds,
        "window_seconds": min(MAX_SECONDS, MAX_SAMPLES * snapshot.interval_seconds),
        "timestamps": [round(s.timestamp, 3) for s in samples],
        "sources": [{"name": s.name, "up": s.up, "state": s.state, "error": s.error, "errors_total": s.errors_total}
                    for s in snapshot.sources],
        "devices": devices,
        "pods": [{"namespace": p.owner.namespace, "pod": p.owner.pod, "cpu_joules": round(p.cpu_joules, 3),
                  "gpu_joules": round(p.gpu_joules, 3)} for p in pods],
    }, separators=(",", ":")).encode()


def _picks(uuids: tuple[str, ...], snapshot: Snapshot) -> list[int]:
    """Where each of the snapshot's devices' FIELDS sit in a sample of devices `uuids`; -1 where absent."""
    where = _positions(uuids)
    return [where[key] * len(FIELDS) + offset if key in where else -1
            for key in _positions(tuple(gpu.uuid for gpu in snapshot.gpus)) for offset in range(len(FIELDS))]


def _positions(uuids: tuple[str, ...]) -> dict[tuple[str, int], int]:
    """(uuid, how many devices before had it) -> index: two sources reporting one device stay two series."""
    seen: dict[str, int] = {}
    positions = {}
    for index, uuid in enumerate(uuids):
        seen[uuid] = seen.get(uuid, -1) + 1
        positions[(uuid, seen[uuid])] = index
    return positions


def page(node_name: str, interval: float, snapshot: Snapshot | None) -> bytes:
    """The page, with node, version and source status filled in for a first paint; its script does the rest."""
    rows = "".join(
        f"<tr><td>{html.escape(s.name)}</td><td class='{s.state}'>{s.state}</td>"
        f"<td>{html.escape(s.error)}</td></tr>" for s in (snapshot.sources if snapshot else ()))
    values = {"NODE": html.escape(node_name), "VERSION": html.escape(__version__), "INTERVAL": f"{interval:g}",
              "SOURCES": rows}
    return re.sub(r"@([A-Z]+)@", lambda match: values[match[1]], _TEMPLATE).encode()
