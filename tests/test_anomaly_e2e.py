"""The anomaly thread in the real agent: a fault injected into a simulated accelerator shows in
its gpu_anomaly_score, and without scikit-learn the agent runs its named detectors and says the
model is off."""

from __future__ import annotations

import statistics
import time

import pytest

from agent import Agent
from scaffold import by_name

pytestmark = pytest.mark.e2e
FAULT_AT = 45.0  # seconds after the start: after the first fit (a quarter of the 1 m window)


def _score(agent: Agent) -> float | None:
    return agent.samples("gpu_anomaly_score").get("0")


def test_a_simulated_fault_shows_in_the_anomaly_score() -> None:
    started = time.monotonic()
    args = ("--sources", "simulated", "--simulate", "2", "--interval", "0.1")
    args += ("--simulate-fault", f"stuck@{FAULT_AT:g}s")
    args += ("--anomaly-window", "1m", "--anomaly-refit", "10m")
    with Agent(*args) as agent:
        agent.wait_for(lambda: _score(agent) is not None, FAULT_AT - 10, "a first model")
        assert agent.samples("kepler_bridge_anomaly_model_fitted_timestamp_seconds").get("0")
        before = []
        while time.monotonic() - started < FAULT_AT - 1:
            before.append(_score(agent) or 0.0)
            time.sleep(0.3)
        usual = statistics.median(before)
        agent.wait_for(
            lambda: (_score(agent) or 0.0) >= max(before) + 0.02, 20, f"a score over {usual:.2f}"
        )
        assert agent.samples("kepler_bridge_anomaly_cpu_seconds_total")[""] > 0


def test_without_scikit_learn_the_agent_runs_the_named_detectors(tmp_path) -> None:
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["sklearn"] = None\n')
    args = ("--sources", "simulated", "--simulate", "1", "--interval", "0.2")
    with Agent(*args, env={"PYTHONPATH": str(tmp_path)}) as agent:
        agent.wait_for(lambda: agent.samples("gpu_anomaly"), 10, "gpu_anomaly series")
        assert not agent.samples("gpu_anomaly_score")
        kinds = {labels["kind"] for labels, _ in by_name(agent.metrics())["gpu_anomaly"]}
        assert "unusual" not in kinds and "stuck" in kinds
        assert "anomaly model off: scikit-learn is not installed" in agent.output()
