"""The gpu-alerts rules and the gpu-fleet recording rules: rendered files up to date, same rules
everywhere, promtool checks and unit tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from assets import CONTRACT_METRICS, generator, metric_names, recording_rules
from promserver import ROOT, binary

ALERTS = ROOT / "alerts"
EXPECTED = {
    "GPUAnomalyDetected",
    "HighGPUUtilization",
    "GPUTemperatureHigh",
    "GPUMemoryNearlyFull",
    "GPUXidCriticalError",
    "GPULost",
    "GPUEccUncorrectable",
    "GPUThermalThrottling",
    "GPUResetRequired",
    "GPURowRemapFailed",
    "GPURemappedRowsUncorrectable",
    "GPUNvLinkErrorsRising",
    "KeplerBridgeDown",
    "KeplerBridgeSourceDown",
    "KeplerBridgeStale",
}
ANNOTATIONS = {"summary", "description", "summary_zh", "description_zh"}
CJK = re.compile(r"[\u4e00-\u9fff]")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _promtool(*args: str, cwd: Path = ALERTS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_rendered_files_match_the_source() -> None:
    for path, text in generator("alerts/render.py").rendered().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path} is out of date: run python scripts/render_assets.py"
        )


def test_plain_file_and_prometheusrules_hold_the_same_rules() -> None:
    render = generator("alerts/render.py")
    plain = _load(render.PLAIN)["groups"]
    for path in render.PROMETHEUS_RULES:
        manifest = _load(path)
        assert manifest["kind"] == "PrometheusRule"
        assert manifest["spec"]["groups"] == plain, path
    assert plain == [render.load_group()]


def test_every_alert_has_severity_and_bilingual_annotations() -> None:
    (group,) = _load(ALERTS / "gpu-alerts.rules.yml")["groups"]
    assert group["name"] == "gpu-alerts"
    assert {rule["alert"] for rule in group["rules"]} == EXPECTED
    for rule in group["rules"]:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert set(rule["annotations"]) == ANNOTATIONS, rule["alert"]
        assert CJK.search(rule["annotations"]["summary_zh"]) and CJK.search(
            rule["annotations"]["description_zh"]
        )
        assert not CJK.search(rule["annotations"]["summary"] + rule["annotations"]["description"])


def test_seed_alert_is_kept_in_base_units() -> None:
    rules = {
        rule["alert"]: rule for rule in _load(ALERTS / "gpu-alerts.rules.yml")["groups"][0]["rules"]
    }
    assert rules["HighGPUUtilization"]["expr"] == "gpu_utilization_ratio > 0.9"
    assert rules["HighGPUUtilization"]["for"] == "5m"
    assert rules["HighGPUUtilization"]["labels"]["severity"] == "warning"
    assert rules["GPULost"]["expr"] == "gpu_up == 0"


def test_promtool_check_rules_accepts_plain_file_and_prometheusrule(tmp_path: Path) -> None:
    result = _promtool("check", "rules", "gpu-alerts.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    spec = _load(ROOT / "manifests" / "kubernetes" / "70-prometheusrule.yaml")["spec"]
    (tmp_path / "from-manifest.yml").write_text(
        yaml.safe_dump(spec, allow_unicode=True), encoding="utf-8"
    )
    result = _promtool("check", "rules", "from-manifest.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", "gpu-alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in _load(ALERTS / "gpu-alerts.test.yml")["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == EXPECTED, f"alerts without a firing test: {EXPECTED - fires}"
    assert quiet == EXPECTED, f"alerts without a quiet test: {EXPECTED - quiet}"


def test_fleet_plain_file_and_prometheusrules_hold_the_same_recording_rules() -> None:
    render = generator("alerts/render.py")
    plain = _load(render.FLEET_PLAIN)["groups"]
    assert plain == [render.load_group(render.FLEET_SOURCE, "gpu-fleet")]
    for path in render.FLEET_RULES:
        manifest = _load(path)
        assert manifest["kind"] == "PrometheusRule"
        assert manifest["metadata"]["name"] == "kepler-bridge-gpu-fleet"
        assert manifest["spec"]["groups"] == plain, path


def test_fleet_group_records_only_and_names_follow_the_convention() -> None:
    rules = recording_rules()
    assert rules and all(set(rule) == {"record", "expr"} for rule in rules), "no alerts here"
    for rule in rules:
        level, _, operation = rule["record"].split(":")
        assert level in {"node", "namespace"} and operation, rule["record"]
        assert f"by ({level})" in rule["expr"], f"{rule['record']} keeps its level's label"
        names = metric_names(rule["expr"])
        assert names and names <= CONTRACT_METRICS, f"{rule['record']}: {names - CONTRACT_METRICS}"


def test_promtool_accepts_the_fleet_rules_and_their_unit_tests_pass(tmp_path: Path) -> None:
    result = _promtool("check", "rules", "gpu-fleet.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    spec = _load(ROOT / "manifests" / "kubernetes" / "71-fleetrules.yaml")["spec"]
    (tmp_path / "from-manifest.yml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    result = _promtool("check", "rules", "from-manifest.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("test", "rules", "gpu-fleet.test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, (
        result.stdout + result.stderr
    )


def test_every_recording_rule_has_a_unit_test() -> None:
    tested = {
        name
        for case in _load(ALERTS / "gpu-fleet.test.yml")["tests"]
        for check in case.get("promql_expr_test", [])
        for name in metric_names(check["expr"])
    }
    recorded = {rule["record"] for rule in recording_rules()}
    assert recorded <= tested, f"recording rules without a unit test: {recorded - tested}"
