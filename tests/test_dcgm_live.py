"""Every query of dcgm-exporter's own Grafana dashboard against a real Prometheus scraping the agent
in --metric-names dcgm mode: 2 simulated GPUs and a fake-NVML GPU the kubelet assigns to a pod.

The queries are in tests/fixtures/dcgm_dashboard_queries.json, with the dashboard's source commit.
"""

from __future__ import annotations

import functools
import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import pynvml
import pytest

from agent import Agent
from fakenvml import FakeNvml
from kubefakes import FakeKube, FakePodResources, list_response, pod, pod_list
from promserver import Prometheus, binary
from scaffold import wait_for

pytestmark = pytest.mark.e2e

QUERIES = json.loads(
    (Path(__file__).parent / "fixtures" / "dcgm_dashboard_queries.json").read_text(encoding="utf-8")
)
# Grafana's "All" for the dashboard's two variables.
SUBSTITUTIONS = {"$Hostname": ".*", "$gpu": ".*"}
ASSIGNED_GPU = "GPU-fa4e0000-0000-4000-8000-000000000000"  # fake GPU 0
POD = ("demo", "inference-0", "server")
CONTAINER_ID = "d" * 64
# GPM metric id -> the rate (%) its counter advances at: the profiling panels' fields.
GPM_RATES = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 62.5,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 25.0,
}
wait_until = functools.partial(wait_for, step=0.25, ignore=(OSError,))


def substitute(expr: str) -> str:
    for name, value in SUBSTITUTIONS.items():
        expr = expr.replace(name, value)
    return expr


def panel(query: dict[str, str]) -> object:
    return pytest.param(query["title"], substitute(query["expr"]), id=query["title"])


@pytest.fixture(scope="module")
def prometheus(
    fakenvml_lib: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Prometheus scraping one agent in dcgm mode every second."""
    binary("prometheus")
    workdir = tmp_path_factory.mktemp("dcgm-live")
    nvml = FakeNvml(fakenvml_lib, workdir / "nvml.conf", gpus=1, processes_per_gpu=1)
    nvml.gpu(0, gpm_supported=True, gpm_metrics=GPM_RATES)  # a Hopper GPU: profiling fields
    with ExitStack() as stop:
        metaserver = stop.enter_context(
            FakeKube(pod_list(pod(POD[0], POD[1], (POD[2], f"cri-o://{CONTAINER_ID}"))))
        )
        socket = workdir / "kubelet.sock"
        assigned = [(POD[2], [("nvidia.com/gpu", [ASSIGNED_GPU])])]
        stop.enter_context(FakePodResources(socket, list_response([(POD[0], POD[1], assigned)])))
        agent = stop.enter_context(
            Agent(
                "--metric-names",
                "dcgm",
                "--simulate",
                "2",
                "--interval",
                "1s",
                "--nvml-library",
                str(fakenvml_lib),
                "--kube-source",
                "metaserver",
                "--metaserver-url",
                metaserver.url,
                "--pod-resources-socket",
                str(socket),
                env=nvml.env(),
            )
        )
        server = Prometheus(workdir, {"dcgm": [agent.url.removeprefix("http://")]})
        stop.callback(server.stop)
        yield server


@pytest.mark.parametrize("title,expr", [panel(query) for query in QUERIES["panels"]])
def test_dashboard_panel_returns_data(prometheus: Prometheus, title: str, expr: str) -> None:
    wait_until(lambda: prometheus.query(expr), 30, f"{title}: {expr}")


def test_the_profiling_panels_read_gpm_as_dcgm_ratios(prometheus: Prometheus) -> None:
    expr = f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{UUID="{ASSIGNED_GPU}"}}'
    found = wait_until(lambda: prometheus.query(expr), 30, expr)
    assert float(found[0]["value"][1]) == pytest.approx(0.625)
    expr = f'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{UUID="{ASSIGNED_GPU}"}}'
    found = wait_until(lambda: prometheus.query(expr), 30, expr)
    assert float(found[0]["value"][1]) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "name,definition", [(v["name"], v["definition"]) for v in QUERIES["variables"]]
)
def test_dashboard_variable_has_values(prometheus: Prometheus, name: str, definition: str) -> None:
    match = re.fullmatch(r"label_values\((.+), *(\w+)\)", substitute(definition))
    assert match, definition
    selector, label = match.groups()
    values = wait_until(
        lambda: prometheus.query(f"count by ({label}) ({selector})"), 30, f"${name}: {definition}"
    )
    assert all(series["metric"].get(label) for series in values), values


def test_the_assigned_gpu_carries_its_pod(prometheus: Prometheus) -> None:
    expr = f'DCGM_FI_DEV_FB_USED{{UUID="{ASSIGNED_GPU}"}}'
    found = wait_until(lambda: prometheus.query(expr), 30, expr)
    labels = found[0]["metric"]
    assert (labels.get("namespace"), labels.get("pod"), labels.get("container")) == POD
    others = prometheus.query('DCGM_FI_DEV_FB_USED{pod=""}')
    assert len(others) == 2, others
