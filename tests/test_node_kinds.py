"""The agent on each kind of node, set up as a shipped manifest sets it up:
alerts fire only where something is wrong.

A kind of node is a host tree (fake sysfs and /usr, NVIDIA and Ascend driver files; the real /proc)
in which `kepler-bridge collect --prometheus` runs with the args and environment of a shipped
workload, each of its mount paths replaced by the hostPath it mounts. The promtool case of
alerts/gpu-alerts.test.yml named for the kind holds as input exactly the series that run exports of
the families the alert rules read; test_alerts.py runs promtool.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import KEPLER_BRIDGE
from assets import ROOT, alert_rules, metric_names
from cpu_helpers import require_bpf
from fakenvml import FakeNvml
from fixtures.ascend import ascend_host
from fixtures.sysfs import FakeSysfs
from kepler_bridge.exposition.catalogue import GPU_LABELS
from scaffold import samples, source_states

NODE = "edge-1"
TARGET = {
    "instance": "10.0.0.1:30060",
    "job": "kepler-bridge",
}  # what Prometheus adds to each scraped series
STEPS = 10  # samples per input series, one a minute
# The newest sample is taken when it is scraped: its input value is the scrape time,
# not this run's clock.
SCRAPE_TIME = "kepler_bridge_last_sample_timestamp_seconds"
_LABEL = re.compile(r'(\w+)="([^"]*)"')
LABEL_ORDER = {
    name: position for position, name in enumerate(GPU_LABELS)
}  # as the other cases write them


pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Kind:
    """A kind of node: the workload the manifests run there, what its host has, what must show."""

    case: str  # name of its promtool case in alerts/gpu-alerts.test.yml
    workload: str  # under manifests/
    nvidia_gpu: bool = False  # an NVIDIA GPU on the PCI bus
    nvidia_library: str = (
        ""  # "": none; "usr": in the host's /usr; "toolkit": injected by the container toolkit
    )
    nvidia_driver: bool = False  # the kernel driver is loaded (NVML starts)
    amd: bool = False
    ascend: bool = False
    kernel_headers: bool = True  # eBPF can load (else procfs counts CPU time)
    states: dict[str, str] = field(
        default_factory=dict
    )  # sources whose state tells the kind's story
    fires: frozenset[str] = frozenset()


KINDS = {
    "nvidia": Kind(
        "No alert fires on a healthy NVIDIA node (kubernetes/30-daemonset.yaml)",
        "kubernetes/30-daemonset.yaml",
        nvidia_gpu=True,
        nvidia_library="usr",
        nvidia_driver=True,
        states={"nvml": "up", "ebpf": "up", "amdgpu": "absent"},
    ),
    "amd": Kind(
        "No alert fires on an AMD node whose /usr has the NVIDIA library but no NVIDIA GPU "
        "(kubernetes/30-daemonset.yaml)",
        "kubernetes/30-daemonset.yaml",
        nvidia_library="usr",
        amd=True,
        states={"nvml": "absent", "amdgpu": "up", "ebpf": "up"},
    ),
    "no-gpu": Kind(
        "No alert fires on a node without accelerators (kubernetes/30-daemonset.yaml)",
        "kubernetes/30-daemonset.yaml",
        states={"nvml": "absent", "ascend": "absent", "ebpf": "up"},
    ),
    "no-ebpf": Kind(
        "No alert fires on an NVIDIA node without kernel headers, where procfs counts CPU time "
        "(kubernetes/hardened/30-daemonset.yaml)",
        "kubernetes/hardened/30-daemonset.yaml",
        nvidia_gpu=True,
        nvidia_library="toolkit",
        nvidia_driver=True,
        kernel_headers=False,
        states={"nvml": "up", "ebpf": "standby", "procfs": "up"},
    ),
    "ascend": Kind(
        "No alert fires on a healthy Ascend node (kubernetes/ascend/30-daemonset.yaml)",
        "kubernetes/ascend/30-daemonset.yaml",
        ascend=True,
        states={"ascend": "up", "nvml": "absent", "ebpf": "up"},
    ),
    "nvidia-driver-down": Kind(
        "KeplerBridgeSourceDown fires when a source keeps failing (NVIDIA GPUs whose "
        "kernel driver is not loaded, kubernetes/30-daemonset.yaml)",
        "kubernetes/30-daemonset.yaml",
        nvidia_gpu=True,
        nvidia_library="usr",
        states={"nvml": "down", "ebpf": "up"},
        fires=frozenset({"KeplerBridgeSourceDown"}),
    ),
}


def workload_command(workload: dict[str, Any], host: Path) -> tuple[list[str], dict[str, str]]:
    """The container's args and env on a node whose / is `host`:
    each mount path becomes the hostPath it mounts."""
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {
        m["mountPath"]: host / volumes[m["name"]]["hostPath"]["path"].lstrip("/")
        for m in container["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }

    def on_host(value: str) -> str:
        parts = []
        for part in value.split(":"):  # also each directory of a search path
            mount = next(
                (
                    m
                    for m in sorted(mounts, key=len, reverse=True)
                    if part == m or part.startswith(m + "/")
                ),
                None,
            )
            parts.append(str(mounts[mount]) + part[len(mount) :] if mount else part)
        return ":".join(parts)

    env = {}
    for variable in container["env"]:
        if "valueFrom" in variable:
            assert variable["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", variable
            env[variable["name"]] = NODE
        else:
            env[variable["name"]] = on_host(variable["value"])
    return [on_host(arg) for arg in container["args"]], env


def build_host(kind: Kind, host: Path, fakenvml_lib: Path) -> dict[str, str]:
    """The kind's host tree under `host`; returns what the node adds to the container's
    environment."""
    (host / "proc").parent.mkdir(parents=True, exist_ok=True)
    (host / "proc").symlink_to("/proc")
    sysfs = FakeSysfs(host / "sys")
    for shared in (
        "devices/system/cpu",
        "fs/cgroup",
    ):  # eBPF sizes its maps and names cgroups from these
        (host / "sys" / shared).parent.mkdir(parents=True, exist_ok=True)
        (host / "sys" / shared).symlink_to(Path("/sys", shared))
    (host / "usr" / "lib").mkdir(parents=True)
    added: dict[str, str] = {}
    if kind.nvidia_gpu:
        sysfs.nvidia_pci("0000:17:00.0")
    if kind.nvidia_library:
        library = host / "usr" / "lib" / f"{platform.machine()}-linux-gnu" / fakenvml_lib.name
        if kind.nvidia_library == "toolkit":
            library = host / "toolkit" / fakenvml_lib.name
            added["LD_LIBRARY_PATH"] = str(library.parent)
        library.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fakenvml_lib, library)
    if kind.nvidia_driver:  # the fake library starts only where it has a configuration
        added |= FakeNvml(fakenvml_lib, host / "fakenvml.conf", gpus=1).env()
    if kind.amd:
        sysfs.amd_rx7900(0, "0000:03:00.0")
    if kind.ascend:
        sysfs.ascend_pci("0000:c1:00.0")
        ascend_host(host)
    if not kind.kernel_headers:
        added["BCC_KERNEL_SOURCE"] = str(host / "no-kernel-headers")
    return added


def collect(kind: Kind, host: Path, fakenvml_lib: Path) -> str:
    """What the agent exports there in one sample, as /metrics would."""
    (workload,) = [
        doc for doc in yaml.safe_load_all((ROOT / "manifests" / kind.workload).read_text()) if doc
    ]
    added = build_host(kind, host, fakenvml_lib)
    args, env = workload_command(workload, host)
    assert args[0] == "serve", args
    inherited = {
        name: value for name, value in os.environ.items() if not name.startswith("KEPLER_BRIDGE_")
    }
    result = subprocess.run(
        [KEPLER_BRIDGE, "collect", "--prometheus", *args[1:]],
        env=inherited | env | added,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def rule_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, labels) -> value of every exported series of the metrics the alert rules read."""
    read = set().union(*(metric_names(rule["expr"]) for rule in alert_rules()))
    return {
        (sample.name, tuple(sample.labels.items())): sample.value
        for sample in samples(text)
        if sample.name in read
    }


def input_series(
    series: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> list[dict[str, str]]:
    """The series as promtool input_series scraped once a minute from a target with the TARGET
    labels, plus `up`."""
    found = []
    for (name, labels), value in series.items():
        ordered = sorted(labels, key=lambda item: LABEL_ORDER.get(item[0], len(LABEL_ORDER)))
        text = ",".join(f'{key}="{label}"' for key, label in (*ordered, *TARGET.items()))
        values = (
            f"0+60x{STEPS}" if name == SCRAPE_TIME else f"{repr(value).removesuffix('.0')}x{STEPS}"
        )
        found.append({"series": f"{name}{{{text}}}", "values": values})
    scrape = ",".join(f'{key}="{label}"' for key, label in TARGET.items())
    return found + [
        {"series": f"up{{{scrape}}}", "values": f"1x{STEPS}"}
    ]  # Prometheus's own: the scrapes work


def by_identity(series: list[dict[str, str]]) -> dict[tuple[str, frozenset[tuple[str, str]]], str]:
    """promtool input_series as (name, label set) -> values,
    whatever order the labels are written in."""
    found = {}
    for entry in series:
        name, _, labels = entry["series"].partition("{")
        found[(name, frozenset(_LABEL.findall(labels)))] = entry["values"]
    return found


def promtool_case(name: str) -> dict[str, Any]:
    """The test case of alerts/gpu-alerts.test.yml with this name."""
    tests = yaml.safe_load((ROOT / "alerts" / "gpu-alerts.test.yml").read_text(encoding="utf-8"))[
        "tests"
    ]
    (case,) = [case for case in tests if case["name"] == name]
    return case


@pytest.mark.parametrize("name", KINDS)
def test_promtool_case_is_what_the_agent_exports_on_that_node(
    name: str, tmp_path: Path, fakenvml_lib: Path
) -> None:
    kind = KINDS[name]
    if kind.kernel_headers:
        require_bpf()
    text = collect(kind, tmp_path / "host", fakenvml_lib)
    states = source_states(text)
    assert {source: states.get(source) for source in kind.states} == kind.states, text
    exported = input_series(rule_series(text))
    case = promtool_case(kind.case)
    listing = "\n".join(
        f"      - series: '{series['series']}'\n        values: '{series['values']}'"
        for series in exported
    )
    assert by_identity(case["input_series"]) == by_identity(exported), (
        f"the input of promtool case {kind.case!r} is not what the agent exports there, which is:\n"
        f"{listing}"
    )
    expected = {rule["alert"]: rule["alert"] in kind.fires for rule in alert_rules()}
    assert {
        check["alertname"]: bool(check["exp_alerts"]) for check in case["alert_rule_test"]
    } == expected
