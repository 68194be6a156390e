"""Render alerts/rules.src.yaml (alerts) and alerts/fleet-rules.src.yaml (fleet recording rules)
each into a Prometheus rule file and PrometheusRule manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "alerts" / "rules.src.yaml"
PLAIN = ROOT / "alerts" / "gpu-alerts.rules.yml"
# One PrometheusRule per self-contained manifest folder; all are the same object.
PROMETHEUS_RULES = (
    ROOT / "manifests" / "kubernetes" / "70-prometheusrule.yaml",
    ROOT / "manifests" / "kubeedge" / "70-prometheusrule.yaml",
)
FLEET_SOURCE = ROOT / "alerts" / "fleet-rules.src.yaml"
FLEET_PLAIN = ROOT / "alerts" / "gpu-fleet.rules.yml"
FLEET_RULES = (
    ROOT / "manifests" / "kubernetes" / "71-fleetrules.yaml",
    ROOT / "manifests" / "kubeedge" / "71-fleetrules.yaml",
)
NAMESPACE = "kepler-bridge"
# kube-prometheus selects rules by prometheus/role, kube-prometheus-stack by release.
RULE_LABELS = {
    "app.kubernetes.io/name": "kepler-bridge",
    "app.kubernetes.io/part-of": "kepler-bridge",
    "prometheus": "k8s",
    "role": "alert-rules",
    "release": "kube-prometheus-stack",
}
HEADER = (
    "# Generated from alerts/{source} by scripts/render_assets.py: edit that file, not this\n"
    "# one, then run python scripts/render_assets.py.\n"
)


def load_group(source: Path = SOURCE, name: str = "gpu-alerts") -> dict[str, Any]:
    """The rule group as written in the source file."""
    group = yaml.safe_load(source.read_text(encoding="utf-8"))
    if not isinstance(group, dict) or group.get("name") != name or not group.get("rules"):
        raise ValueError(f"{source}: expected a mapping with name: {name} and a rules list")
    return group


def _dump(document: dict[str, Any], source: Path) -> str:
    """YAML text with keys in source order and Chinese kept readable."""
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=1_000_000)
    return HEADER.format(source=source.name) + text


def plain_rules(group: dict[str, Any], source: Path = SOURCE) -> str:
    """The rule file that Prometheus loads through `rule_files`."""
    return _dump({"groups": [group]}, source)


def prometheus_rule(group: dict[str, Any], source: Path = SOURCE) -> str:
    """The prometheus-operator PrometheusRule carrying the same group."""
    return _dump(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": {
                "name": f"kepler-bridge-{group['name']}",
                "namespace": NAMESPACE,
                "labels": RULE_LABELS,
            },
            "spec": {"groups": [group]},
        },
        source,
    )


def rendered(group: dict[str, Any] | None = None) -> dict[Path, str]:
    """Every generated file and the text it must hold."""
    group = load_group() if group is None else group
    fleet = load_group(FLEET_SOURCE, "gpu-fleet")
    outputs = {PLAIN: plain_rules(group)}
    outputs.update({path: prometheus_rule(group) for path in PROMETHEUS_RULES})
    outputs[FLEET_PLAIN] = plain_rules(fleet, FLEET_SOURCE)
    outputs.update({path: prometheus_rule(fleet, FLEET_SOURCE) for path in FLEET_RULES})
    return outputs
