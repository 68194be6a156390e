"""Counters continue when gunicorn replaces a killed worker, through the real agent."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path

import pytest
import requests

from agent import Agent
from powercap import PowercapTree
from scaffold import families

# Counters that count from the agent's start (or from the source's start, for the simulated GPUs):
# without the carried state a new worker would start each of them again from zero.
RESTARTING = (
    "kepler_bridge_node_cpu_joules_total",
    "kepler_bridge_pod_cpu_joules_total",
    "kepler_bridge_process_cpu_joules_total",
    "kepler_bridge_node_gpu_idle_joules_total",
    "kepler_bridge_pod_gpu_joules_total",
    "gpu_energy_joules_total",
    "kepler_bridge_process_cpu_seconds_total",
)


pytestmark = pytest.mark.e2e


def counters(agent: Agent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """Every counter series of the agent (not prometheus_client's process_*, which describe one
    worker process), or None while no worker answers with a sample."""
    try:
        text = agent.metrics()
    except requests.RequestException:
        return None
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families(text).values()
        if family.type == "counter" and not family.name.startswith("process_")
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def state_dirs(master: int) -> list[Path]:
    return [
        path
        for place in ("/dev/shm", tempfile.gettempdir())
        for path in Path(place).glob(f"kepler-bridge-{master}-*")
    ]


def test_counters_continue_from_their_last_value_in_a_new_worker(tmp_path: Path) -> None:
    tree = PowercapTree(tmp_path / "sys")
    tree.zone("intel-rapl:0", "package-0", 0)
    with (
        tree.drawing("intel-rapl:0", watts=100.0),
        Agent(
            "--simulate",
            "2",
            "--sources",
            "procfs,rapl",
            "--sysfs",
            str(tree.sysfs),
            "--interval",
            "0.25s",
            "--cpu-tdp-watts",
            "0",
        ) as agent,
    ):
        (state,) = state_dirs(agent.process.pid)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        before = agent.wait_for(
            lambda: (
                (found := counters(agent))
                and {name for (name, _), value in found.items() if value > 0} >= set(RESTARTING)
                and found
            ),
            what="every restarting counter above zero",
        )
        (worker,) = agent.worker_pids()
        os.kill(worker, signal.SIGKILL)
        agent.wait_for(
            lambda: agent.worker_pids() not in ([], [worker]),
            what="the master to start a new worker",
        )
        after = agent.wait_for(lambda: counters(agent), what="the new worker's first sample")
    assert not state_dirs(agent.process.pid), "the master left its state directory behind"
    for name in RESTARTING:
        assert any(key[0] == name for key in set(before) & set(after)), (
            f"{name} missing before or after the restart"
        )
    lower = {
        key: (value, after[key])
        for key, value in before.items()
        if key in after and after[key] < value
    }
    assert not lower, f"counters went down in the new worker: {lower}"
