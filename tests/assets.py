"""Read the observability assets (alert rules, dashboards) the way the tests need them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import yaml

from kepler_bridge.exposition.catalogue import METRICS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import render_assets  # noqa: E402


def generator(relative: str) -> ModuleType:
    """A generator script (alerts/render.py, grafana/dashboards.py, manifests/render.py)
    as a module."""
    return render_assets.load(ROOT / relative)


DASHBOARDS = sorted((ROOT / "grafana").glob("*.json"))
# What Grafana puts in place of its variables when the tests run a panel's query.
SUBSTITUTIONS = {
    "$__rate_interval": "10s",
    "$__interval": "5s",
    "$__range": "1m",
    "$__range_s": "60",
    "$node": ".*",
    "$gpu": ".*",
    "$namespace": ".*",
    "$pod": ".*",
}
# The metric catalogue (docs/design.md, "Metrics"; tests/test_design.py keeps it equal to METRICS),
# plus prometheus_client's process series the dashboards use and Prometheus' own per-target series.
CONTRACT_METRICS = set(METRICS) | {
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "up",
    "scrape_samples_scraped",
    "scrape_duration_seconds",
}
# A name not followed by "(" (a function) nor by a label matcher such as =, =~, != or !~; a
# recorded one (level:metric:operations) as a whole.
_METRIC = re.compile(
    r"\b([a-z_]+:[a-z0-9_]+:[a-z0-9_]+|(?:gpu|kepler_bridge|process|scrape)_[a-z_]+|up)\b"
    r"(?!\s*\()(?![=!]~|!=|=(?!=))"
)
_LABEL_VALUES = re.compile(r"label_values\((.+), *(\w+)\)")
_NAME_REGEX = re.compile(r'__name__=~"([^"]+)"')


def alert_rules() -> list[dict[str, Any]]:
    """The rules of the gpu-alerts group as Prometheus loads them."""
    (group,) = yaml.safe_load(
        (ROOT / "alerts" / "gpu-alerts.rules.yml").read_text(encoding="utf-8")
    )["groups"]
    return group["rules"]


def recording_rules() -> list[dict[str, Any]]:
    """The rules of the gpu-fleet recording-rule group as Prometheus loads them."""
    (group,) = yaml.safe_load(
        (ROOT / "alerts" / "gpu-fleet.rules.yml").read_text(encoding="utf-8")
    )["groups"]
    return group["rules"]


def load_dashboard(path: Path) -> dict[str, Any]:
    """One dashboard model."""
    return json.loads(path.read_text(encoding="utf-8"))


def panel_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard title, panel title, PromQL with Grafana's variables filled in)
    for every panel target."""
    for path in DASHBOARDS:
        model = load_dashboard(path)
        for panel in model["panels"]:
            for query in panel.get("targets", []):
                yield model["title"], panel["title"], substitute(query["expr"])


def variable_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard title, variable name, PromQL counting the values) for every label_values()
    variable."""
    for path in DASHBOARDS:
        model = load_dashboard(path)
        for item in model["templating"]["list"]:
            if item["type"] == "query":
                match = _LABEL_VALUES.fullmatch(item["definition"])
                assert match, (
                    f"{model['title']}: ${item['name']} is not label_values(selector, label)"
                )
                selector, label = match.groups()
                yield model["title"], item["name"], substitute(f"count by ({label}) ({selector})")


def substitute(expr: str) -> str:
    """Replace Grafana's variables, longest first so $__range is not read as $__r..."""
    for name in sorted(SUBSTITUTIONS, key=len, reverse=True):
        expr = expr.replace(name, SUBSTITUTIONS[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, including those of __name__ regexes such as (cpu|gpu)."""
    names = {match for match in _METRIC.findall(expr) if match not in {"group_left", "group_right"}}
    for pattern in _NAME_REGEX.findall(expr):
        names |= {name for name in CONTRACT_METRICS if re.fullmatch(pattern, name)}
    return names
