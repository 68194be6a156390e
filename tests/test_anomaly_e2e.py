"""The anomaly thread in the real agent: each device's model fitted in the child and fitted again on
schedule, a score per device, and a stuck fault injected into a simulated accelerator raising its
gpu_anomaly_score over what the model gave its normal."""

from __future__ import annotations

import statistics
import time

import pytest

from agent import Agent
from scaffold import by_name

pytestmark = pytest.mark.e2e
# Seed 139's first accelerator has a load wave of 60.4 s: the 720 rows the model keeps, one a
# sample at 0.1 s, hold a whole cycle of it from the second fit (a minute after the first) on. A
# model that saw only part of the cycle finds every later sample new, the fault's and the normal
# alike, as a load that changes faster than the window does.
SEED, REFIT, FAULT_AT = 139, 60.0, 90.0


def _fitted(agent: Agent) -> float:
    return agent.samples("kepler_bridge_anomaly_model_fitted_timestamp_seconds").get("0", 0.0)


def _score(agent: Agent) -> float:
    return agent.samples("gpu_anomaly_score")["0"]


def test_a_stuck_accelerator_raises_its_score_over_its_normal() -> None:
    started = time.monotonic()
    args = ("--sources", "simulated", "--simulate", "2", "--simulate-seed", str(SEED))
    args += ("--interval", "0.1", "--simulate-fault", f"stuck@{FAULT_AT:g}s")
    args += ("--anomaly-window", "1m", "--anomaly-refit", f"{REFIT:g}s")
    with Agent(*args) as agent:
        agent.wait_for(lambda: len(agent.samples("gpu_anomaly_score")) == 2, 60, "two scores")
        first = _fitted(agent)
        assert abs(first - time.time()) < 60, first
        agent.wait_for(lambda: _fitted(agent) > first, REFIT + 20, "the second fit")
        assert agent.samples("kepler_bridge_anomaly_cpu_seconds_total")[""] > 0
        normal = []
        while time.monotonic() - started < FAULT_AT - 1:
            normal.append(_score(agent))
            time.sleep(0.2)
        assert len(normal) >= 5, "the second fit came too late to see the normal before the fault"
        agent.wait_for(lambda: agent.samples("gpu_utilization_ratio").get("0") == 1.0, 20, "stuck")
        faulty = []
        while len(faulty) < 30:
            faulty.append(_score(agent))
            time.sleep(0.2)
        usual = max(normal)
        assert statistics.median(faulty) >= usual + 0.03, (statistics.median(faulty), normal)
        power, limit = agent.samples("gpu_power_watts")["0"], agent.samples("gpu_power_limit_watts")
        assert power < 0.3 * limit["0"], "a stuck kernel draws little more than idle"
        kinds = {labels["kind"] for labels, _ in by_name(agent.metrics())["gpu_anomaly"]}
        assert {"unusual", "stuck"} <= kinds
