"""Grafana dashboards: generated files up to date, importable shape, variables,
contract metric names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from assets import (
    CONTRACT_METRICS,
    DASHBOARDS,
    ROOT,
    alert_rules,
    generator,
    load_dashboard,
    metric_names,
    panel_queries,
    recording_rules,
    variable_queries,
)
from promserver import binary

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
UIDS = {
    "accelerators.json": "kepler-bridge-accelerators",
    "workload-energy.json": "kepler-bridge-workload-energy",
    "agent.json": "kepler-bridge-agent",
    "fleet.json": "kepler-bridge-fleet",
}
RECORDED = {rule["record"] for rule in recording_rules()}


def test_dashboard_files_match_the_generator() -> None:
    outputs = generator("grafana/dashboards.py").rendered()
    assert sorted(path.name for path in outputs) == sorted(path.name for path in DASHBOARDS)
    for path, text in outputs.items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is out of date: run python scripts/render_assets.py"
        )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_dashboard_is_importable_with_stable_uid_and_datasource_variable(path) -> None:
    model = load_dashboard(path)
    assert model["uid"] == UIDS[path.name]
    assert "id" not in model, "an exported id would clash on import"
    variables = {item["name"]: item for item in model["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    assert "node" in variables
    for item in variables.values():
        if item["type"] == "query":
            assert item["datasource"] == DATASOURCE
    for panel in model["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for query in panel["targets"]:
            assert query["datasource"] == DATASOURCE, panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda path: path.name)
def test_panels_have_unique_ids_and_do_not_overlap(path) -> None:
    panels = load_dashboard(path)["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area


def test_accelerators_has_the_seed_panels_and_gpu_variable() -> None:
    model = load_dashboard(ROOT / "grafana" / "accelerators.json")
    assert "gpu" in {item["name"] for item in model["templating"]["list"]}
    kinds = {(panel["type"], panel["title"]) for panel in model["panels"]}
    assert ("timeseries", "GPU utilization") in kinds
    assert ("heatmap", "Temperature heatmap") in kinds
    assert ("bargauge", "Memory in use") in kinds
    titles = {title for _, title in kinds}
    assert {"Power", "Energy in the selected range", "Clocks", "Health", "XID errors"} <= titles


def test_every_query_uses_only_contract_metric_names() -> None:
    expressions = [expr for _, _, expr in panel_queries()] + [
        rule["expr"] for rule in alert_rules()
    ]
    for expr in expressions:
        names = metric_names(expr)
        assert names, f"no metric name found in {expr!r}"
        assert names <= CONTRACT_METRICS | RECORDED, (
            f"{expr!r} uses {names - CONTRACT_METRICS - RECORDED}, "
            "neither in the metric catalogue (docs/design.md) nor in alerts/gpu-fleet.rules.yml"
        )


def test_fleet_dashboard_reads_only_the_recording_rules() -> None:
    queries = [expr for dashboard, _, expr in panel_queries() if dashboard == "Accelerator fleet"]
    used: set[str] = set()
    for expr in queries:
        names = metric_names(expr)
        assert names and names <= RECORDED, f"{expr!r} reads raw series {names - RECORDED}"
        used |= names
    assert used == RECORDED, f"recorded but not shown: {RECORDED - used}"


def test_every_variable_is_substituted_for_the_live_queries() -> None:
    for dashboard, panel, expr in panel_queries():
        assert "$" not in expr, f"{dashboard} / {panel}: unknown variable in {expr!r}"


def test_power_by_namespace_adds_each_namespaces_cpu_and_gpu_power(tmp_path: Path) -> None:
    (expr,) = (
        e
        for dashboard, panel, e in panel_queries()
        if (dashboard, panel) == ("Accelerator fleet", "Power by namespace (CPU + GPU)")
    )
    series = [("gpu", "ml", "100"), ("cpu", "ml", "50"), ("cpu", "web", "20")]
    case = {
        "interval": "1m",
        "input_series": [
            {
                "series": f'namespace:kepler_bridge_pod_{kind}_joules:rate5m{{namespace="{ns}"}}',
                "values": f"{watts}x5",
            }
            for kind, ns, watts in series
        ],
        "promql_expr_test": [
            {
                "expr": expr,
                "eval_time": "3m",
                "exp_samples": [
                    {"labels": '{namespace="ml"}', "value": 150},
                    {"labels": '{namespace="web"}', "value": 20},
                ],
            }
        ],
    }
    _promtool_passes(tmp_path, case)


def test_fleet_namespace_variable_lists_namespaces_with_cpu_energy_only(tmp_path: Path) -> None:
    # Most namespaces use no GPU: the variable must offer them for the CPU side of the panels.
    (expr,) = (
        e
        for dashboard, name, e in variable_queries()
        if (dashboard, name) == ("Accelerator fleet", "namespace")
    )
    series = [("gpu", "ml"), ("cpu", "ml"), ("cpu", "web")]
    case = {
        "interval": "1m",
        "input_series": [
            {
                "series": f'namespace:kepler_bridge_pod_{kind}_joules:rate5m{{namespace="{ns}"}}',
                "values": "10x5",
            }
            for kind, ns in series
        ],
        "promql_expr_test": [
            {
                "expr": f"clamp_max({expr}, 1)",
                "eval_time": "3m",
                "exp_samples": [
                    {"labels": '{namespace="ml"}', "value": 1},
                    {"labels": '{namespace="web"}', "value": 1},
                ],
            }
        ],
    }
    _promtool_passes(tmp_path, case)


def _promtool_passes(tmp_path: Path, case: dict) -> None:
    """Run one promtool unit-test case (no rules) and require it to pass."""
    path = tmp_path / "panel.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "tests": [case]}))
    run = subprocess.run(
        [binary("promtool"), "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
