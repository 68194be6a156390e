"""Debian's Prometheus and Alertmanager against running agents on loopback.

Three agents feed one `kepler-bridge` job. The healthy one has 2 simulated GPUs and 2 fake-NVML GPUs
with faults injected (busy, hot, memory full, thermally throttled, XID 79, a growing ECC count, one
GPU lost), a CPU estimate for node energy, and a container workload: a process in a test cgroup that
also uses fake GPU 0, named as pod demo/inference-0 by a stub MetaServer; a stub kubelet
pod-resources socket assigns fake GPU 0 to that pod. The second agent's only source cannot start
(KeplerBridgeSourceDown); the third one's driver hangs after start-up (KeplerBridgeStale). A dead
port is a fourth target (KeplerBridgeDown).
"""

from __future__ import annotations

import functools
import os
import subprocess
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from agent import Agent
from assets import alert_rules, panel_queries, recording_rules, variable_queries
from cpu_helpers import Burner
from fakenvml import FakeNvml, default_process
from fixtures.sysfs import FakeSysfs
from kubefakes import FakeKube, FakePodResources, list_response, pod, pod_list
from promserver import Alertmanager, HttpStub, Prometheus, binary, http_get
from scaffold import free_port, require, wait_for

LOST_GPU = 1
ASSIGNED_GPU = "GPU-fa4e0000-0000-4000-8000-000000000000"  # fake GPU 0
HUNG_DRIVER_MS = 120_000
# KeplerBridgeStale needs the newest sample to be more than 30 s older than the scrape.
STALE_AFTER_S = 30
# Unique per run: other test runs on the machine may use the same kind of cgroup at the same time.
CONTAINER_ID = f"{os.getpid():016x}" * 4
POD = {"namespace": "demo", "pod": "inference-0", "container": "server"}
# Prometheus is asked over HTTP: a refused or reset request counts as "not yet".
wait_until = functools.partial(wait_for, step=0.25, ignore=(OSError,))


pytestmark = pytest.mark.e2e


@dataclass
class Stack:
    """Everything the tests query."""

    prometheus: Prometheus
    webhook: HttpStub
    agents: list[Agent]
    lost_uuid: str


@contextmanager
def container_workload() -> Iterator[Burner]:
    """A CPU-burning child in a CRI-O style cgroup,
    so the agent sees it as container CONTAINER_ID."""
    root = next(
        (
            path
            for path in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
            if (path / "cgroup.controllers").exists()
        ),
        None,
    )
    require(
        os.geteuid() == 0, "not root: the live Prometheus test puts a workload in a test cgroup"
    )
    if root is None:
        pytest.fail(
            "no cgroup v2 hierarchy is mounted: the live Prometheus test needs one to create a "
            "container cgroup",
            pytrace=False,
        )
    cgroup = root / f"kepler-bridge-live-test-{os.getpid()}" / f"crio-{CONTAINER_ID}.scope"
    cgroup.mkdir(parents=True, exist_ok=True)
    try:
        with Burner(preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0")) as burner:
            yield burner
    finally:
        # The kernel empties a cgroup shortly after its last process is reaped.
        wait_until(
            lambda: "populated 0" in (cgroup / "cgroup.events").read_text(),
            10,
            f"{cgroup} to empty",
        )
        cgroup.rmdir()
        cgroup.parent.rmdir()


def _inject_gpu_faults(fake: FakeNvml, workload_pid: int) -> None:
    """Faults on the healthy agent's fake GPU 0, which the container workload uses."""
    total = 80 * 2**30
    used = int(total * 0.97)
    fake.gpu(
        0,
        utilization_gpu=97,
        temperature=95,
        memory_total=total,
        memory_used=used,
        memory_free=total - used - 2**20,
        memory_reserved=2**20,
        clocks_event_reasons=0x20 | 0x40,  # sw_thermal_slowdown | hw_thermal_slowdown
        remapped_rows_failure=1,
        nvlink_count=2,
    )
    fake.processes(0, [default_process(workload_pid)])


@pytest.fixture(scope="module")
def stack(fakenvml_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Agents, Alertmanager with a webhook and Prometheus; all stopped at the end."""
    for name in ("prometheus", "prometheus-alertmanager", "promtool"):
        binary(name)
    workdir = tmp_path_factory.mktemp("prometheus")
    healthy_nvml = FakeNvml(fakenvml_lib, workdir / "healthy.conf", gpus=2, processes_per_gpu=1)
    hung_nvml = FakeNvml(fakenvml_lib, workdir / "hung.conf", gpus=1)
    with ExitStack() as stop:
        workload = stop.enter_context(container_workload())
        workload.burn(0.2)
        _inject_gpu_faults(healthy_nvml, workload.pid)
        metaserver = stop.enter_context(
            FakeKube(
                pod_list(
                    pod(POD["namespace"], POD["pod"], (POD["container"], f"cri-o://{CONTAINER_ID}"))
                )
            )
        )
        kubelet_socket = workdir / "kubelet.sock"
        stop.enter_context(
            FakePodResources(
                kubelet_socket,
                list_response(
                    [
                        (
                            POD["namespace"],
                            POD["pod"],
                            [(POD["container"], [("nvidia.com/gpu", [ASSIGNED_GPU])])],
                        )
                    ]
                ),
            )
        )
        healthy = stop.enter_context(
            Agent(
                "--simulate",
                "2",
                "--interval",
                "1s",
                "--nvml-library",
                str(fakenvml_lib),
                "--cpu-tdp-watts",
                "65",
                "--anomaly-window",  # a first model (gpu_anomaly_score) within about 30 s
                "1m",
                "--kube-source",
                "metaserver",
                "--metaserver-url",
                metaserver.url,
                "--pod-resources-socket",
                str(kubelet_socket),
                env=healthy_nvml.env(),
            )
        )
        gpu_host = FakeSysfs(workdir / "gpu-host" / "sys")
        gpu_host.nvidia_pci(
            "0000:17:00.0"
        )  # an NVIDIA GPU is there, so a driver that does not load is down
        broken = stop.enter_context(
            Agent(
                "--sources",
                "nvml",
                "--interval",
                "1s",
                "--sysfs",
                str(gpu_host.root),
                "--nvml-library",
                str(workdir / "missing" / "libnvidia-ml.so.1"),
                ready=False,
            )
        )
        hung = stop.enter_context(
            Agent(
                "--sources",
                "nvml",
                "--interval",
                "1s",
                "--nvml-library",
                str(fakenvml_lib),
                env=hung_nvml.env(),
            )
        )
        webhook = HttpStub()
        stop.callback(webhook.stop)
        alertmanager = Alertmanager(workdir, webhook.url + "/alerts")
        stop.callback(alertmanager.stop)
        targets = [agent.url.removeprefix("http://") for agent in (healthy, broken, hung)]
        prometheus = Prometheus(
            workdir,
            {"kepler-bridge": [*targets, f"127.0.0.1:{free_port()}"]},
            alertmanager=alertmanager.address,
        )
        stop.callback(prometheus.stop)
        # Faults of a running agent: an XID event (NVML delivers events only to a registered
        # listener), a GPU falling off the bus (its uuid was read before), a growing ECC count, a
        # driver that hangs.
        healthy_nvml.add_xid(0, 79)
        healthy_nvml.gpu(LOST_GPU, lost=True)
        wait_until(
            lambda: (
                len(
                    prometheus.query(
                        'count_over_time(gpu_ecc_errors_total{kind="uncorrected"}[1m]) >= 3'
                    )
                )
                >= 2
            ),
            30,
            "Prometheus to record ECC counters",
        )
        # 2 kJ more on GPU 0's energy counter (2 kW for a 1 s interval: a step a board can make,
        # where 5 kW is taken for garbage): shared by its only process, the container workload.
        # Rows remapped and NVLink replays as the ECC count grows.
        healthy_nvml.gpu(
            0,
            ecc_uncorrected_volatile=3,
            ecc_uncorrected_aggregate=3,
            total_energy=1_002_000_000,
            remapped_rows_uncorrectable=1,
            nvlink_replay=[0, 3],
        )
        hung_nvml.set(delay_ms=HUNG_DRIVER_MS)
        workload.burn(0.2)
        lost_uuid = f"GPU-fa4e0000-0000-4000-8000-{LOST_GPU:012x}"
        yield Stack(prometheus, webhook, [healthy, broken, hung], lost_uuid)


def test_agent_output_passes_promtool_check_metrics(stack: Stack) -> None:
    for agent in stack.agents:
        body = http_get(agent.url + "/metrics")
        result = subprocess.run(
            [binary("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=30
        )
        findings = (result.stdout + result.stderr).decode().strip()
        assert result.returncode == 0 and not findings, findings


def test_prometheus_scrapes_every_agent_and_sees_the_dead_one(stack: Stack) -> None:
    def ups() -> dict[str, float]:
        return {
            series["metric"]["instance"]: float(series["value"][1])
            for series in stack.prometheus.query('up{job="kepler-bridge"}')
        }

    values = wait_until(
        lambda: (found := ups()) and len(found) == 4 and found, 30, "four targets scraped"
    )
    assert sorted(values.values()) == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_returns_series(stack: Stack, rule: dict) -> None:
    timeout = STALE_AFTER_S + 30 if rule["alert"] == "KeplerBridgeStale" else 30
    wait_until(
        lambda: stack.prometheus.query(rule["expr"]), timeout, f"{rule['alert']} to select a series"
    )


@pytest.mark.parametrize("rule", recording_rules(), ids=lambda rule: rule["record"])
def test_recording_rule_records_series(stack: Stack, rule: dict) -> None:
    wait_until(
        lambda: stack.prometheus.query(rule["record"]), 30, f"{rule['record']} to be recorded"
    )


@pytest.mark.parametrize(
    "dashboard,panel,expr",
    list(panel_queries()),
    ids=[f"{dashboard}/{panel}/{n}" for n, (dashboard, panel, _) in enumerate(panel_queries())],
)
def test_dashboard_query_returns_series(
    stack: Stack, dashboard: str, panel: str, expr: str
) -> None:
    wait_until(lambda: stack.prometheus.query(expr), 30, f"{dashboard} / {panel}: {expr}")


@pytest.mark.parametrize(
    "dashboard,variable,expr",
    list(variable_queries()),
    ids=[f"{dashboard}/${name}" for dashboard, name, _ in variable_queries()],
)
def test_dashboard_variable_has_values(
    stack: Stack, dashboard: str, variable: str, expr: str
) -> None:
    wait_until(lambda: stack.prometheus.query(expr), 30, f"{dashboard} ${variable}: {expr}")


def test_workload_energy_names_the_pod(stack: Stack) -> None:
    def pods() -> set[tuple[str, str]]:
        series = stack.prometheus.query("kepler_bridge_pod_gpu_joules_total > 0")
        return {(s["metric"].get("namespace", ""), s["metric"].get("pod", "")) for s in series}

    wait_until(lambda: (POD["namespace"], POD["pod"]) in pods(), 30, "GPU energy of the demo pod")


def test_gpu_memory_alert_names_the_pod_its_gpu_is_assigned_to(stack: Stack) -> None:
    rule = next(rule for rule in alert_rules() if rule["alert"] == "GPUMemoryNearlyFull")

    def owners() -> dict[str, str]:
        return {
            s["metric"]["uuid"]: s["metric"].get("pod", "")
            for s in stack.prometheus.query(rule["expr"])
        }

    wait_until(
        lambda: owners().get(ASSIGNED_GPU) == POD["pod"],
        30,
        "the memory alert of GPU 0 to name its pod",
    )


def test_lost_gpu_fires_gpulost_and_alertmanager_delivers_it(stack: Stack) -> None:
    firing = wait_until(
        lambda: stack.prometheus.firing("GPULost"), 60, "GPULost to fire in Prometheus"
    )
    assert {alert["labels"].get("uuid") for alert in firing} == {stack.lost_uuid}, firing
    delivered = wait_until(
        lambda: stack.webhook.alerts("GPULost"), 30, "Alertmanager to deliver GPULost"
    )
    alert = delivered[-1]
    assert alert["labels"]["uuid"] == stack.lost_uuid
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["node"] == "test-node"
    assert "cannot be read" in alert["annotations"]["summary"]
    assert "掉卡" in alert["annotations"]["summary_zh"]
