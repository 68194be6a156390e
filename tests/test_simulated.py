"""Simulated accelerators: seedable identity, values that move, physics that holds."""

from __future__ import annotations

import subprocess
import time

import pytest

from agent import KEPLER_BRIDGE
from kepler_bridge import __version__
from kepler_bridge.sources.simulated import SimulatedSource
from scaffold import make_config


def source(seed: int, count: int = 3) -> SimulatedSource:
    sim = SimulatedSource(make_config(simulate=count, simulate_seed=seed))
    sim.start()
    return sim


def test_same_seed_same_devices_other_seed_other_devices() -> None:
    first, again, other = (source(7).read().gpus, source(7).read().gpus, source(8).read().gpus)
    assert [(g.uuid, g.memory_total_bytes) for g in first] == [
        (g.uuid, g.memory_total_bytes) for g in again
    ]
    assert [g.uuid for g in first] != [g.uuid for g in other]
    assert len(first) == 3 and [g.index for g in first] == [0, 1, 2]


def test_readings_are_plausible_and_move() -> None:
    sim = source(1, count=2)
    readings = []
    for _ in range(4):
        readings.append(sim.read().gpus[0])
        time.sleep(0.3)
    for gpu in readings:
        assert 0 <= gpu.utilization <= 1 and 0 < gpu.memory_used_bytes < gpu.memory_total_bytes
        assert gpu.power_watts <= gpu.power_limit_watts and 0 < gpu.temperature_celsius < 100
        assert (
            gpu.processes
            and sum(p.memory_used_bytes for p in gpu.processes) <= gpu.memory_used_bytes
        )
    assert len({g.utilization for g in readings}) > 1
    energies = [g.energy_joules for g in readings]
    assert energies == sorted(energies) and energies[-1] > energies[0]


@pytest.mark.e2e
def test_version() -> None:
    result = subprocess.run(
        [KEPLER_BRIDGE, "--version"], capture_output=True, text=True, timeout=20
    )
    assert result.returncode == 0 and result.stdout.strip() == f"kepler-bridge {__version__}"
