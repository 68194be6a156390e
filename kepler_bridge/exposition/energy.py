"""The energy counter families: the node's CPU zones and the joules attributed to processes,
containers and pods. A row with no accelerator energy has no accelerator-energy series."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import Metric

from kepler_bridge.exposition.catalogue import ENERGY_COUNTERS, ENERGY_LEVELS
from kepler_bridge.exposition.families import counter, pod_labels
from kepler_bridge.model import Snapshot, WorkloadEnergy


def energy_families(snap: Snapshot) -> Iterator[Metric]:
    """The node's CPU zones, then each attributed-energy family of a kind the node has."""
    energy = snap.energy
    zones = counter("kepler_bridge_node_cpu_joules_total", ("node", "zone", "source"))
    for zone in energy.cpu_zones:
        zones.add_metric([snap.node, zone.zone, zone.source], zone.joules)
    yield zones
    # A kind the node has no energy of gets no attributed series: absent, not zeros.
    known = {"cpu": bool(energy.cpu_zones), "gpu": bool(energy.gpu_idle)}
    rows = {
        ("process", "cpu"): energy.cpu_processes,
        ("process", "gpu"): energy.gpu_processes,
        ("container", "cpu"): energy.containers,
        ("container", "gpu"): energy.containers,
        ("pod", "cpu"): energy.pods,
        ("pod", "gpu"): energy.pods,
    }
    for name, level, kind in ENERGY_COUNTERS:
        if known[kind]:
            yield _energy_family(name, snap.node, level, kind, rows[level, kind])


def _energy_family(
    name: str, node: str, level: str, kind: str, rows: tuple[WorkloadEnergy, ...]
) -> Metric:
    """One attributed-energy counter: a series per row, with its level's labels and its owner's.

    A row without GPU energy (a process, container or pod that never used an accelerator) has
    no GPU series; one with some keeps it while it lives, as its joules never decrease."""
    own, pod = ENERGY_LEVELS[level]
    family = counter(name, ("node",) + own + pod)
    for row in rows:
        joules = row.cpu_joules if kind == "cpu" else row.gpu_joules
        if kind == "gpu" and not joules:
            continue
        values = [node, *(getattr(row, label) for label in own), *pod_labels(row.owner, pod)]
        family.add_metric(values, joules)
    return family
