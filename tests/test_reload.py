"""Settings re-read while the agent runs.

By a changed config file or SIGHUP; a refused file; a setting that needs a restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from agent import Agent
from kepler_bridge.config import load
from kepler_bridge.http.app import WebSettings
from kepler_bridge.reload import DerivedSettings
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore
from scaffold import make_config, samples, stat_line, values

COMMAND_DEVICE = {
    "devices": [{"uuid": "npu-reloaded", "usedMemory": 1, "totalMemory": 4, "percent": 25}]
}


def _write(path: Path, settings: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(settings))
    temporary.replace(path)  # as a ConfigMap update swaps the file


def _settings(**extra: object) -> dict:
    return {"sources": ["simulated"], "simulate": 2, "interval": "0.3s", **extra}


def _energy(agent: Agent) -> float:
    return sum(agent.samples("gpu_energy_joules_total").values())


def _names(agent: Agent) -> set[str]:
    return {sample.name for sample in samples(agent.metrics())}


@pytest.mark.e2e
def test_a_changed_config_file_applies_without_a_restart_and_counters_go_on(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        worker = agent.worker_pids()
        assert "gpu_temperature_celsius" not in _names(agent) and "gpu_power_watts" in _names(agent)
        agent.wait_for(lambda: _energy(agent) > 0, what="energy counted")
        before = _energy(agent)
        _write(path, _settings(metrics_deny=["gpu_power"]))
        agent.wait_for(
            lambda: "gpu_power_watts" not in _names(agent), what="the new deny list applied"
        )
        assert "gpu_temperature_celsius" in _names(agent)
        assert _energy(agent) >= before, "a reload must not restart the counters"
        assert agent.worker_pids() == worker, (
            "a reload must not replace the worker (drivers and eBPF stay)"
        )
        assert "settings reloaded: metrics_deny" in agent.output()


@pytest.mark.e2e
def test_sighup_rereads_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        worker = agent.worker_pids()
        # Same size, inode and time: only SIGHUP can tell the agent the file changed.
        stamp = path.stat()
        text = path.read_text()
        path.write_text(text.replace("gpu_temperature", "gpu_utilization"))
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        assert path.stat().st_size == stamp.st_size and path.stat().st_ino == stamp.st_ino
        agent.process.send_signal(signal.SIGHUP)
        agent.wait_for(
            lambda: "gpu_utilization_ratio" not in _names(agent), what="SIGHUP applying the file"
        )
        assert "gpu_temperature_celsius" in _names(agent)
        assert agent.worker_pids() == worker


@pytest.mark.e2e
def test_sighup_applies_at_once_not_at_the_next_sample(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(interval="1h", metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        agent.wait_for(lambda: "gpu_power_watts" in _names(agent), what="the first sample")
        _write(path, _settings(interval="0.3s", metrics_deny=["gpu_power"]))
        agent.process.send_signal(signal.SIGHUP)
        agent.wait_for(
            lambda: "gpu_power_watts" not in _names(agent), what="SIGHUP applying the file"
        )
        agent.wait_for(lambda: _energy(agent) > 0, what="samples at the new interval")


def _hup_ignored_or_caught(pid: int) -> bool:
    """Whether the process no longer ends at a SIGHUP (its /proc status masks, bit 0)."""
    masks = dict(line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return bool((int(masks["SigIgn"], 16) | int(masks["SigCgt"], 16)) & 1)


@pytest.mark.e2e
def test_a_reload_while_the_agent_starts_is_neither_fatal_nor_lost(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    agent = Agent("--config", str(path))
    stop, signalled, changed = threading.Event(), [], []

    def reload_often() -> None:
        """SIGHUP the master and its worker every 20 ms from when the master stops ending at
        one; change the file as the worker appears."""
        while not stop.is_set() and (agent.process is None or agent.process.poll() is None):
            time.sleep(0.02)
            try:
                if agent.process is None or not _hup_ignored_or_caught(agent.process.pid):
                    continue
                workers = agent.worker_pids()
            except FileNotFoundError:  # the agent has ended
                return
            if workers and not changed:
                _write(path, _settings(metrics_deny=["gpu_power"]))
                changed.append(workers)
            for pid in [agent.process.pid, *workers]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGHUP)
                    signalled.append(pid)

    hups = threading.Thread(target=reload_often)
    try:
        hups.start()
        with agent:
            agent.wait_for(lambda: "gpu_power_watts" not in _names(agent), what="the change")
            stop.set()
            hups.join()
            assert "gpu_temperature_celsius" in _names(agent)
            assert len(set(signalled)) >= 2 and "killed" not in agent.output()
    finally:
        stop.set()
        hups.join()


@pytest.mark.e2e
def test_a_bad_file_is_refused_in_one_line_and_the_running_settings_stay(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        path.write_text("interval: [not, a, duration\n")
        agent.wait_for(lambda: "settings not reloaded" in agent.output(), what="the refusal logged")
        refusals = [line for line in agent.output().splitlines() if "settings not reloaded" in line]
        assert len(refusals) == 1 and "YAML syntax error" in refusals[0], refusals
        assert "gpu_temperature_celsius" not in _names(agent)
        assert agent.get("/readyz").status_code == 200
        _write(path, _settings(metrics_deny=["gpu_utilization"], interval="1m"))
        agent.wait_for(
            lambda: "gpu_temperature_celsius" in _names(agent), what="the fixed file applied"
        )


@pytest.mark.e2e
def test_a_file_start_up_would_refuse_is_refused_whole(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        refused = {
            "unknown source 'bogus'": {"sources": ["simulated", "bogus"]},
            "web_config_file": {"web_config_file": str(tmp_path / "missing.yml")},
        }
        for count, (reason, change) in enumerate(refused.items(), start=1):
            _write(path, {**_settings(metrics_deny=["gpu_power"]), **change})
            agent.wait_for(
                lambda: agent.output().count("settings not reloaded") == count, what=reason
            )
            refusals = [line for line in agent.output().splitlines() if "not reloaded" in line]
            assert reason in refusals[-1], refusals
            assert "gpu_power_watts" in _names(agent), "a refused file changed a setting"


@pytest.mark.e2e
def test_a_file_emptied_to_be_rewritten_in_place_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        path.write_text("")  # as `>` leaves it before the new text comes
        agent.wait_for(lambda: "is empty (being written?)" in agent.output(), what="the refusal")
        assert "gpu_temperature_celsius" not in _names(agent)
        path.write_text(yaml.safe_dump(_settings(metrics_deny=["gpu_power"])))
        agent.wait_for(lambda: "gpu_power_watts" not in _names(agent), what="the new text")


@pytest.mark.e2e
def test_a_setting_that_needs_a_restart_is_kept_and_named(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    command = tmp_path / "collector.sh"
    command.write_text(f"#!/bin/sh\necho '{__import__('json').dumps(COMMAND_DEVICE)}'\n")
    command.chmod(0o755)
    _write(path, _settings())
    with Agent("--config", str(path)) as agent:
        assert agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 2
        _write(path, _settings(simulate=5, command=[str(command)]))
        agent.wait_for(
            lambda: agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 3,
            what="the command source added by the reload",
        )
        assert "except simulate: restart the agent" in agent.output()


@pytest.mark.e2e
def test_source_errors_never_decrease_when_a_reload_changes_or_unsets_the_command(
    tmp_path: Path,
) -> None:
    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    path = tmp_path / "agent.yaml"
    _write(path, _settings(interval="0.1s", command=[str(failing), "first"]))
    seen: list[float] = []  # every value served, in order
    with Agent("--config", str(path)) as agent:

        def errors() -> float | None:
            found = values(agent.metrics(), "kepler_bridge_source_errors_total", "source")
            if "command" in found:
                seen.append(found["command"])
            return found.get("command")

        agent.wait_for(lambda: (errors() or 0) >= 5, what="the failing command counted")
        for command in ([str(failing), "second"], None, [str(failing), "third"]):
            _write(path, _settings(interval="0.1s", **({"command": command} if command else {})))
            counted = seen[-1]
            agent.wait_for(
                lambda: (errors() or 0) > counted if command else errors() is None,
                what=f"the reload to command {command} applied",
            )
            for _ in range(5):
                errors()
                time.sleep(0.05)
    assert seen == sorted(seen), f"kepler_bridge_source_errors_total went down: {seen}"


def test_the_web_settings_are_made_once_per_settings_change() -> None:
    running = make_config(metrics_deny="gpu_temperature")
    made = []
    settings = DerivedSettings(
        lambda: running, lambda config: made.append(config) or WebSettings.of(config)
    )
    assert settings() is settings() and made == [running]
    assert not settings().render.metric_allowed("gpu_temperature_celsius")
    running = dataclasses.replace(running, metrics_deny=("gpu_power",))  # what a reload does
    assert settings().render.metric_allowed("gpu_temperature_celsius") and made[1:] == [running]
    assert not settings().render.metric_allowed("gpu_power_watts") and len(made) == 2


@pytest.mark.e2e
@pytest.mark.parametrize("file_then", ["as reloaded", "broken"])
def test_a_worker_that_replaces_a_crashed_one_keeps_the_reloaded_settings(
    tmp_path: Path, file_then: str
) -> None:
    """Not the start-up ones, even where the file no longer loads when the new worker starts: the
    master holds what the last reload took."""
    path = tmp_path / "agent.yaml"
    _write(path, _settings(metrics_deny=["gpu_temperature"]))
    with Agent("--config", str(path)) as agent:
        _write(path, _settings(metrics_deny=["gpu_power"]))
        agent.wait_for(
            lambda: "gpu_power_watts" not in _names(agent), what="the new deny list applied"
        )
        if file_then == "broken":
            path.write_text("interval: [not, a, duration\n")
            agent.wait_for(
                lambda: "settings not reloaded" in agent.output(), what="the refusal logged"
            )
        (crashed,) = agent.worker_pids()
        os.kill(crashed, signal.SIGKILL)
        agent.wait_for(
            lambda: agent.worker_pids() not in ([], [crashed]), timeout=30, what="a new worker"
        )
        agent.wait_for(lambda: agent.get("/readyz").status_code == 200, what="the new worker ready")
        names = _names(agent)
        assert "gpu_power_watts" not in names and "gpu_temperature_celsius" in names, (
            "the new worker went back to the start-up settings"
        )


def test_a_reloaded_process_grace_reaches_the_cpu_source(tmp_path: Path) -> None:
    """The procfs source drops an ended process by the grace in force, not the start-up one."""
    proc = tmp_path / "proc"
    for pid in (1, 4242):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(stat_line(pid, "worker", 30, 10, 5000))
        (proc / str(pid) / "cgroup").write_text("0::/init.scope\n")
    (proc / "self").symlink_to("1")
    path = tmp_path / "agent.yaml"
    settings = {
        "sources": ["procfs"],
        "procfs": str(proc),
        "interval": "0.1s",
        "kube_source": "off",
        "pod_resources_socket": "",
        "process_metrics": "all",
    }
    _write(path, {**settings, "process_grace": "1h"})
    flags = {"config": str(path)}
    store = SnapshotStore()
    sampler = Sampler(load(flags, {}), store, flags=flags)
    sampler.start()
    try:
        _until(lambda: 4242 in _pids(store), "the process seen")
        _write(path, {**settings, "process_grace": "0s"})
        _until(lambda: sampler.config.process_grace == 0, "the new grace read")
        shutil.rmtree(proc / "4242")
        _until(lambda: 4242 not in _pids(store), "the ended process dropped (process_grace 0s)")
    finally:
        sampler.stop()


def _pids(store: SnapshotStore) -> set[int]:
    snapshot = store.latest()
    return {row.pid for row in snapshot.processes} if snapshot else set()


def _until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
