"""The anomaly thread in the real agent: it fits each device's model in a child, exports a score
per device and fits again on schedule; a simulated fault reaches the readings it watches; without
scikit-learn the agent runs its named detectors and says the model is off. What the model makes of
a fault is asserted on labelled traces in test_anomaly.py: the simulated load's slow waves outrun
a one-minute window, so its score here says little."""

from __future__ import annotations

import time

import pytest

from agent import Agent
from scaffold import by_name

pytestmark = pytest.mark.e2e
FAULT_AT = 20.0  # seconds after the start


def _fitted(agent: Agent) -> float:
    return agent.samples("kepler_bridge_anomaly_model_fitted_timestamp_seconds").get("0", 0.0)


def test_the_model_is_fitted_scored_per_device_and_refitted() -> None:
    args = ("--sources", "simulated", "--simulate", "2", "--interval", "0.1")
    args += ("--simulate-fault", f"stuck@{FAULT_AT:g}s")
    args += ("--anomaly-window", "1m", "--anomaly-refit", "10s")
    with Agent(*args) as agent:
        agent.wait_for(lambda: len(agent.samples("gpu_anomaly_score")) == 2, 60, "two scores")
        first = _fitted(agent)
        assert abs(first - time.time()) < 60, first
        scores = agent.samples("gpu_anomaly_score")
        assert all(0.0 < score < 1.0 for score in scores.values()), scores
        agent.wait_for(lambda: _fitted(agent) > first, 40, "a second fit 10 s after the first")
        assert agent.samples("kepler_bridge_anomaly_cpu_seconds_total")[""] > 0
        agent.wait_for(lambda: agent.samples("gpu_utilization_ratio").get("0") == 1.0, 40, "stuck")
        power, limit = agent.samples("gpu_power_watts")["0"], agent.samples("gpu_power_limit_watts")
        assert power < 0.3 * limit["0"], "a stuck kernel draws little more than idle"
        kinds = {labels["kind"]: value for labels, value in by_name(agent.metrics())["gpu_anomaly"]}
        assert "unusual" in kinds and "stuck" in kinds


def test_without_scikit_learn_the_agent_runs_the_named_detectors(tmp_path) -> None:
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["sklearn"] = None\n')
    args = ("--sources", "simulated", "--simulate", "1", "--interval", "0.2")
    with Agent(*args, env={"PYTHONPATH": str(tmp_path)}) as agent:
        agent.wait_for(lambda: agent.samples("gpu_anomaly"), 10, "gpu_anomaly series")
        assert not agent.samples("gpu_anomaly_score")
        kinds = {labels["kind"] for labels, _ in by_name(agent.metrics())["gpu_anomaly"]}
        assert "unusual" not in kinds and "stuck" in kinds
        assert "anomaly model off: scikit-learn is not installed" in agent.output()
