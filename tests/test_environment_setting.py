"""--device-environment: off, the agent reads no other process's environment and the devices stay
without an owner; turned on by a reload, the same rig assigns them. doctor says, on that rig,
where the device assignments come from."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from agent import KEPLER_BRIDGE, Agent
from fakenvml import FakeNvml
from kepler_bridge.kube.view import KubeView
from kepler_bridge.model import PodRef
from kepler_bridge.sampling.device_check import _environment
from kepler_bridge.sampling.environment import EnvironmentDevices, EnvironmentTally
from kubeedge_rig import AMD, kubeedge_rig, no_owner
from scaffold import by_name


def write_settings(path: Path, device_environment: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump({"device_environment": device_environment}))
    temporary.replace(path)  # as a ConfigMap update swaps the file


@pytest.mark.e2e
def test_off_reads_no_environ_and_a_reload_to_on_assigns(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    settings = tmp_path / "agent.yaml"
    write_settings(settings, "off")
    with kubeedge_rig(fake_nvml, tmp_path) as args:
        with Agent(
            *args, *("--interval", "200ms", "--config", str(settings)), env=fake_nvml.env()
        ) as agent:

            def pods_known() -> dict:
                found = by_name(agent.metrics())
                named = "pod metadata from the metaserver" in agent.output()
                return found if named and no_owner(found) > 0 else {}

            first = agent.wait_for(pods_known, timeout=30, what="the pods named")
            started = first["kepler_bridge_last_sample_timestamp_seconds"][0][1]

            def seconds_later(since: float) -> dict:
                now = by_name(agent.metrics())
                stamp = now["kepler_bridge_last_sample_timestamp_seconds"][0][1]
                return now if stamp > since + 1.5 else {}

            off = agent.wait_for(lambda: seconds_later(started), timeout=30, what="samples later")
            write_settings(settings, "on")
            on = agent.wait_for(
                lambda: by_name(agent.metrics()) if "gpu_pod_info" in agent.metrics() else {},
                timeout=30,
                what="devices learned from the environment once it is on",
            )
    # Off: nothing names the devices' holders, and the card's active energy has no owner.
    assert "gpu_pod_info" not in off
    assert no_owner(off) - no_owner(first) > 100  # 200 W above idle for over 1.5 s
    assert {labels["source"] for labels, _ in on["gpu_pod_info"]} == {"environment"}
    assert {labels["uuid"]: labels["pod"] for labels, _ in on["gpu_pod_info"]}[AMD] == "infer-0"
    assert "settings reloaded: device_environment" in agent.output()


def doctor(args: list[str], env: dict[str, str]) -> str:
    """doctor's devices line."""
    result = subprocess.run(
        [KEPLER_BRIDGE, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    (line,) = [line for line in result.stdout.splitlines() if line.split()[1:2] == ["devices"]]
    return line


@pytest.mark.e2e
def test_doctor_says_where_the_device_assignments_come_from(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    with kubeedge_rig(fake_nvml, tmp_path) as args:
        on = doctor(args, fake_nvml.env())
        off = doctor([*args, "--device-environment", "off"], fake_nvml.env())
    absent = f"no pod-resources socket at {tmp_path / 'absent.sock'}"
    assert on == (
        f"ok  devices    {absent}; devices from the environment: "
        "2 containers read, 2 give devices, 0 reads failed"
    )
    assert (
        off
        == f"--  devices    {absent}; --device-environment off: no device is given to a container"
    )


def test_failed_reads_are_counted_with_their_cause_and_a_refusal_names_the_capability(
    tmp_path: Path,
) -> None:
    procfs = tmp_path / "proc"
    (procfs / "6" / "environ").mkdir(parents=True)  # reading it fails: EISDIR
    learned = EnvironmentDevices(str(procfs), container_of=lambda pid: "c1")
    kube = KubeView({"c1": PodRef("ml", "train", "main")}, learn_from_environment=True)
    learned.view(kube, {"c1"}, [(6, "x", "c1")], ())
    assert learned.tally() == EnvironmentTally(0, 0, 1, os.strerror(errno.EISDIR))
    denied = EnvironmentTally(3, 2, 1, os.strerror(errno.EACCES))
    assert _environment(denied).endswith(
        "1 reads failed (Permission denied: give the agent CAP_SYS_PTRACE to read environ, and "
        "CAP_DAC_READ_SEARCH for containers of another uid)"
    )
    off = EnvironmentDevices(str(procfs), container_of=lambda pid: "c1", enabled=False)
    assert off.view(kube, {"c1"}, [(6, "x", "c1")], ()) is kube and off.reads == 0
