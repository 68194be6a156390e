"""The scaffold: require() fails under CI and skips elsewhere, the poller, the parsers."""

from __future__ import annotations

import pytest

from scaffold import (
    by_name,
    families,
    make_config,
    require,
    samples,
    source_states,
    values,
    wait_for,
)

TEXT = """# HELP gpu_up Whether the device answers.
# TYPE gpu_up gauge
gpu_up{gpu="0",node="n1"} 1.0
gpu_up{gpu="1",node="n1"} 0.0
# HELP kepler_bridge_source_state The state of each source.
# TYPE kepler_bridge_source_state gauge
kepler_bridge_source_state{source="nvml",state="up"} 1.0
kepler_bridge_source_state{source="nvml",state="down"} 0.0
kepler_bridge_source_state{source="ebpf",state="standby"} 1.0
# HELP kepler_bridge_source_errors_total Errors of each source.
# TYPE kepler_bridge_source_errors_total counter
kepler_bridge_source_errors_total{source="nvml"} 3.0
"""


def test_require_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    require(True, "never shown")
    with pytest.raises(pytest.skip.Exception, match="not root"):
        require(False, "not root")


def test_require_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    require(True, "never shown")
    with pytest.raises(pytest.fail.Exception, match="no cgroup v2 .*CI must offer it"):
        require(False, "no cgroup v2")


def test_wait_for_returns_the_first_truthy_result_and_names_what_it_waited_for() -> None:
    answers = iter([None, OSError("refused"), 0, "ready"])

    def check() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for(check, 5, "ready", step=0.01, ignore=(OSError,)) == "ready"
    with pytest.raises(AssertionError, match="the moon not met within 0.05 s; log:\nthe tail"):
        wait_for(lambda: False, 0.05, "the moon", step=0.01, log=lambda: "the tail")
    with pytest.raises(OSError):
        wait_for(lambda: open("/nonexistent/file"), 1, "a file", step=0.01)


def test_parsers_read_one_metrics_text() -> None:
    assert set(families(TEXT)) == {
        "gpu_up",
        "kepler_bridge_source_state",
        "kepler_bridge_source_errors",
    }
    assert [sample.value for sample in samples(TEXT, "gpu_up")] == [1.0, 0.0]
    assert len(samples(TEXT)) == 6
    assert values(TEXT, "gpu_up", "gpu") == {"0": 1.0, "1": 0.0}
    assert values(TEXT, "kepler_bridge_source_errors_total", "source") == {"nvml": 3.0}
    assert by_name(TEXT)["gpu_up"][1] == ({"gpu": "1", "node": "n1"}, 0.0)
    assert source_states(TEXT) == {"nvml": "up", "ebpf": "standby"}


def test_make_config_takes_settings_as_flag_text_and_no_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEPLER_BRIDGE_MAX_PROCESSES", "7")
    settings = make_config(max_processes=3, sources="procfs")
    assert (settings.max_processes, settings.sources) == (3, ("procfs",))
    assert make_config().max_processes != 7
