"""Generate the importable Grafana dashboards (grafana/*.json) from one description per panel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GPU = 'node=~"$node", gpu=~"$gpu"'
NODE = 'node=~"$node"'
POD = 'node=~"$node", namespace=~"$namespace", pod=~"$pod"'
# prometheus_client's process_* and Prometheus' scrape_* series carry no node label:
# joining on the agent's build_info adds it and keeps only kepler-bridge targets.
BY_NODE = f"* on (instance, job) group_left (node) kepler_bridge_build_info{{{NODE}}}"
TAGS = ["kepler-bridge", "gpu"]
# Every pod with energy (host processes are the pod "").
PODS = '__name__=~"kepler_bridge_pod_(cpu|gpu)_joules_total"'
# Device series carry no pod: the one container a GPU is assigned to comes from gpu_pod_info.
OWNER = "* on (node, uuid) group_left (namespace, pod, container) gpu_pod_info"


def target(
    expr: str, legend: str = "", instant: bool = False, table: bool = False
) -> dict[str, Any]:
    """One Prometheus query of a panel."""
    query: dict[str, Any] = {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
    }
    if table:
        query["format"] = "table"
    return query


def panel(
    kind: str,
    title: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    description: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """A panel of any type; its position and id are filled in by `layout`."""
    for ref, query in zip("ABCDEFGH", targets):
        query["refId"] = ref
    body: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    _merge(body, extra)
    return body


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    """Deep-merge `extra` into `base`, `extra` winning."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def timeseries(
    title: str, targets: list[dict[str, Any]], unit: str, **extra: Any
) -> dict[str, Any]:
    """A time series graph with the legend as a table of last/max values."""
    options = {
        "legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel("timeseries", title, targets, unit, options=options, **extra)


def stat(title: str, expr: str, unit: str = "short", **extra: Any) -> dict[str, Any]:
    """A single number."""
    return panel(
        "stat",
        title,
        [target(expr, instant=True)],
        unit,
        width=6,
        height=4,
        options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        **extra,
    )


def bars(
    title: str, targets: list[dict[str, Any]], unit: str, maximum: float | None = None, **extra: Any
) -> dict[str, Any]:
    """Vertical bars, one per series (a bar chart of the current values)."""
    defaults: dict[str, Any] = {"unit": unit, "min": 0}
    if maximum is not None:
        defaults["max"] = maximum
    return panel(
        "bargauge",
        title,
        targets,
        unit,
        options={
            "orientation": "vertical",
            "displayMode": "gradient",
            "reduceOptions": {"calcs": ["lastNotNull"]},
        },
        fieldConfig={"defaults": defaults, "overrides": []},
        **extra,
    )


def table(
    title: str, targets: list[dict[str, Any]], hide: list[str], rename: dict[str, str], **extra: Any
) -> dict[str, Any]:
    """Instant queries merged into one row per series."""
    transformations = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {
                "excludeByName": {name: True for name in ["Time", *hide]},
                "renameByName": rename,
            },
        },
    ]
    return panel("table", title, targets, width=24, transformations=transformations, **extra)


def variable(name: str, query: str, label: str) -> dict[str, Any]:
    """A multi-value label_values variable with All meaning any value."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "sort": 3,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def datasource_variable() -> dict[str, Any]:
    """The Prometheus data source, chosen when the dashboard is opened."""
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
    }


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Place panels left to right in rows 24 units wide and number them."""
    x = y = row_height = 0
    for number, item in enumerate(panels, start=1):
        width, height = item["gridPos"]["w"], item["gridPos"]["h"]
        if x + width > 24:
            x, y, row_height = 0, y + row_height, 0
        item["gridPos"] = {"x": x, "y": y, "w": width, "h": height}
        item["id"] = number
        x, row_height = x + width, max(row_height, height)
    return panels


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: list[dict[str, Any]],
    panels: list[dict[str, Any]],
) -> dict[str, Any]:
    """A complete dashboard model that Grafana's Import accepts."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "links": [
            {
                "title": "kepler-bridge",
                "type": "dashboards",
                "tags": ["kepler-bridge"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout(panels),
    }


def accelerators() -> dict[str, Any]:
    """Per-GPU health and activity: the seed's utilization, temperature heatmap and memory bars,
    and more."""
    health_rename = {
        "Value #A": "Up",
        "Value #B": "Active throttle reasons",
        "Value #C": "Uncorrected ECC errors",
        "Value #D": "XID errors",
    }
    panels = [
        stat("GPUs up", f"sum(gpu_up{{{GPU}}})"),
        stat(
            "GPUs lost",
            f"sum(1 - gpu_up{{{GPU}}})",
            fieldConfig={
                "defaults": {
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
                    }
                }
            },
        ),
        stat("Mean utilization", f"avg(gpu_utilization_ratio{{{GPU}}})", "percentunit"),
        stat("Power draw", f"sum(gpu_power_watts{{{GPU}}})", "watt"),
        timeseries(
            "GPU utilization",
            [target(f"gpu_utilization_ratio{{{GPU}}}", "{{node}} GPU {{gpu}}")],
            "percentunit",
            width=24,
            fieldConfig={"defaults": {"min": 0, "max": 1}},
        ),
        panel(
            "heatmap",
            "Temperature heatmap",
            [target(f"gpu_temperature_celsius{{{GPU}}}")],
            "celsius",
            description="How many GPUs were at each temperature over time.",
            options={
                "calculate": True,
                "calculation": {"yBuckets": {"mode": "size", "value": "5"}},
                "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                "yAxis": {"unit": "celsius"},
                "cellGap": 1,
                "tooltip": {"show": True, "yHistogram": True},
            },
        ),
        bars(
            "Memory in use",
            [
                target(
                    f"gpu_memory_used_bytes{{{GPU}}} / (gpu_memory_total_bytes{{{GPU}}} > 0)",
                    "{{node}} GPU {{gpu}}",
                    instant=True,
                )
            ],
            "percentunit",
            maximum=1,
        ),
        timeseries(
            "Memory used",
            [
                target(f"gpu_memory_used_bytes{{{GPU}}}", "{{node}} GPU {{gpu}} used"),
                target(f"gpu_memory_total_bytes{{{GPU}}}", "{{node}} GPU {{gpu}} total"),
            ],
            "bytes",
        ),
        timeseries(
            "Temperature",
            [target(f"gpu_temperature_celsius{{{GPU}}}", "{{node}} GPU {{gpu}}")],
            "celsius",
        ),
        timeseries(
            "Power",
            [
                target(f"gpu_power_watts{{{GPU}}}", "{{node}} GPU {{gpu}}"),
                target(f"gpu_power_limit_watts{{{GPU}}}", "{{node}} GPU {{gpu}} limit"),
            ],
            "watt",
        ),
        bars(
            "Energy in the selected range",
            [
                target(
                    f"increase(gpu_energy_joules_total{{{GPU}}}[$__range])",
                    "{{node}} GPU {{gpu}}",
                    instant=True,
                )
            ],
            "joule",
        ),
        timeseries(
            "Clocks",
            [
                target(f"gpu_sm_clock_hertz{{{GPU}}}", "{{node}} GPU {{gpu}} SM"),
                target(f"gpu_memory_clock_hertz{{{GPU}}}", "{{node}} GPU {{gpu}} memory"),
            ],
            "hertz",
        ),
        timeseries(
            "Throttle reasons active",
            [target(f"gpu_throttled{{{GPU}}} == 1", "{{node}} GPU {{gpu}} {{reason}}")],
            "short",
        ),
        timeseries(
            "Anomalies firing",
            [target(f"gpu_anomaly{{{GPU}}} == 1", "{{node}} GPU {{gpu}} {{kind}}")],
            "short",
            description="The anomaly detectors firing on each GPU, by kind (README, Anomaly "
            "detection); GPUAnomalyDetected alerts after 2 minutes of one.",
        ),
        timeseries(
            "Anomaly score (IsolationForest)",
            [target(f"gpu_anomaly_score{{{GPU}}}", "{{node}} GPU {{gpu}}")],
            "percentunit",
            description="How unlike its own last hour each GPU's latest sample is: about 50 % "
            "and below is ordinary; none before a GPU's first model or without scikit-learn.",
            fieldConfig={"defaults": {"min": 0, "max": 1}},
        ),
        table(
            "Health",
            [
                target(f"gpu_up{{{GPU}}}", instant=True, table=True),
                target(f"sum without (reason) (gpu_throttled{{{GPU}}})", instant=True, table=True),
                target(
                    f'sum without (kind) (gpu_ecc_errors_total{{{GPU}, kind="uncorrected"}})',
                    instant=True,
                    table=True,
                ),
                target(
                    f"sum without (xid) (gpu_xid_errors_total{{{GPU}}})", instant=True, table=True
                ),
            ],
            hide=["__name__", "instance", "job"],
            rename=health_rename,
            description="Up = 1 when the driver answers. Counters run since the agent started.",
        ),
        table(
            "XID errors",
            [target(f"gpu_xid_errors_total{{{GPU}}} > 0", instant=True, table=True)],
            hide=["__name__", "instance", "job"],
            rename={"Value": "Count since agent start"},
            description="Critical XIDs (48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120) also raise "
            "GPUXidCriticalError.",
        ),
    ]
    # gpu_up is exported whatever the metric allow/deny lists say.
    variables = [
        variable("node", "label_values(gpu_up, node)", "Node"),
        variable("gpu", 'label_values(gpu_up{node=~"$node"}, gpu)', "GPU"),
    ]
    return dashboard(
        "kepler-bridge-accelerators",
        "Accelerators",
        "Utilization, temperature, memory, power, energy, clocks and health of every accelerator.",
        variables,
        panels,
    )


def workload_energy() -> dict[str, Any]:
    """Power and energy by namespace, pod and container, Kepler-style."""

    def joules(level: str, by: str, window: str = "$__rate_interval", fn: str = "rate") -> str:
        # CPU and GPU series share their labels once rate() drops the names: tag the GPU side
        # before `or`.
        selector = f"{{{POD}}}[{window}]"
        cpu = f"{fn}(kepler_bridge_{level}_cpu_joules_total{selector})"
        gpu = (
            f"label_replace({fn}(kepler_bridge_{level}_gpu_joules_total{selector}),"
            ' "kind", "gpu", "", "")'
        )
        return f"sum by ({by}) ({cpu} or {gpu})"

    def split(level: str, kind: str, by: str) -> str:
        return (
            f"sum by ({by}) (rate(kepler_bridge_{level}_{kind}_joules_total"
            f"{{{POD}}}[$__rate_interval]))"
        )

    panels = [
        timeseries(
            "Power by namespace (CPU + GPU)",
            [target(joules("pod", "namespace"), "{{namespace}}")],
            "watt",
            fieldConfig={"defaults": {"custom": {"stacking": {"mode": "normal"}}}},
        ),
        bars(
            "Energy by namespace in the selected range",
            [
                target(
                    joules("pod", "namespace", "$__range", "increase"),
                    "{{namespace}}",
                    instant=True,
                )
            ],
            "joule",
        ),
        timeseries(
            "GPU power by pod",
            [target(split("pod", "gpu", "namespace, pod"), "{{namespace}}/{{pod}}")],
            "watt",
        ),
        timeseries(
            "CPU power by pod",
            [target(split("pod", "cpu", "namespace, pod"), "{{namespace}}/{{pod}}")],
            "watt",
        ),
        timeseries(
            "GPU utilization by pod",
            [
                target(
                    f"gpu_utilization_ratio{{{NODE}}} {OWNER}{{{POD}}}",
                    "{{namespace}}/{{pod}} GPU {{gpu}}",
                )
            ],
            "percentunit",
            fieldConfig={"defaults": {"min": 0, "max": 1}},
            description=(
                "GPUs the kubelet assigned to exactly one container (pod-resources socket)."
            ),
        ),
        timeseries(
            "GPU memory by pod",
            [
                target(
                    f"gpu_memory_used_bytes{{{NODE}}} {OWNER}{{{POD}}}",
                    "{{namespace}}/{{pod}} GPU {{gpu}}",
                )
            ],
            "bytes",
            description=(
                "GPUs the kubelet assigned to exactly one container (pod-resources socket)."
            ),
        ),
        timeseries(
            "Power by container (CPU + GPU)",
            [
                target(
                    joules("container", "namespace, pod, container"),
                    "{{namespace}}/{{pod}}/{{container}}",
                )
            ],
            "watt",
            width=24,
        ),
        timeseries(
            "Top 10 processes by power",
            [
                target(
                    f"topk(10, {joules('process', 'node, pid, comm, namespace, pod')})",
                    "{{comm}} ({{pid}}) {{namespace}}/{{pod}} on {{node}}",
                )
            ],
            "watt",
        ),
        timeseries(
            "CPU time by container",
            [
                target(
                    "sum by (namespace, pod, container) (rate("
                    f"kepler_bridge_container_cpu_seconds_total{{{POD}}}[$__rate_interval]))",
                    "{{namespace}}/{{pod}}/{{container}}",
                )
            ],
            "short",
            description="CPU seconds per second (1 = one core busy).",
        ),
        timeseries(
            "Node power",
            [
                target(
                    "sum by (node, zone) (rate("
                    f"kepler_bridge_node_cpu_joules_total{{{NODE}}}[$__rate_interval]))",
                    "{{node}} CPU {{zone}}",
                ),
                target(
                    "sum by (node) (rate("
                    f"kepler_bridge_node_gpu_idle_joules_total{{{NODE}}}[$__rate_interval]))",
                    "{{node}} GPU idle",
                ),
            ],
            "watt",
            description="Idle GPU power is power that no process was using.",
        ),
        table(
            "GPU memory by process",
            [
                target(f"gpu_process_memory_used_bytes{{{POD}}}", instant=True, table=True),
            ],
            hide=["__name__", "instance", "job", "uuid", "vendor", "model"],
            rename={"Value": "Memory used"},
            fieldConfig={"defaults": {"unit": "bytes"}},
        ),
    ]
    variables = [
        variable("node", "label_values(kepler_bridge_build_info, node)", "Node"),
        variable("namespace", f'label_values({{{PODS}, node=~"$node"}}, namespace)', "Namespace"),
        variable(
            "pod", f'label_values({{{PODS}, node=~"$node", namespace=~"$namespace"}}, pod)', "Pod"
        ),
    ]
    return dashboard(
        "kepler-bridge-workload-energy",
        "Workload energy",
        "Power and energy of namespaces, pods, containers and processes from CPU time and GPU use.",
        variables,
        panels,
    )


def agent() -> dict[str, Any]:
    """The agent's own health: sources, sampling, scrapes and its process."""
    panels = [
        stat("Agents up", 'sum(up{job=~".*kepler-bridge.*"})'),
        stat(
            "Sources down",
            f"count(kepler_bridge_source_up{{{NODE}}} == 0) or vector(0)",
            fieldConfig={
                "defaults": {
                    "thresholds": {
                        "mode": "absolute",
                        "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
                    }
                }
            },
        ),
        stat("Slowest sample", f"max(kepler_bridge_sample_duration_seconds{{{NODE}}})", "s"),
        stat(
            "Oldest sample age",
            f"max(timestamp(kepler_bridge_last_sample_timestamp_seconds{{{NODE}}}) "
            f"- kepler_bridge_last_sample_timestamp_seconds{{{NODE}}})",
            "s",
        ),
        panel(
            "state-timeline",
            "Sources up",
            [target(f"kepler_bridge_source_up{{{NODE}}}", "{{node}} {{source}}")],
            width=24,
            fieldConfig={
                "defaults": {
                    "min": 0,
                    "max": 1,
                    "mappings": [
                        {
                            "type": "value",
                            "options": {
                                "0": {"text": "down", "color": "red"},
                                "1": {"text": "up", "color": "green"},
                            },
                        }
                    ],
                }
            },
        ),
        timeseries(
            "Source errors",
            [
                target(
                    f"rate(kepler_bridge_source_errors_total{{{NODE}}}[$__rate_interval])",
                    "{{node}} {{source}}",
                )
            ],
            "short",
            description="Failed reads per second.",
        ),
        timeseries(
            "Sample duration",
            [target(f"kepler_bridge_sample_duration_seconds{{{NODE}}}", "{{node}}")],
            "s",
        ),
        timeseries(
            "Samples per scrape", [target(f"scrape_samples_scraped {BY_NODE}", "{{node}}")], "short"
        ),
        timeseries(
            "Scrape duration", [target(f"scrape_duration_seconds {BY_NODE}", "{{node}}")], "s"
        ),
        timeseries(
            "Process CPU",
            [target(f"rate(process_cpu_seconds_total[$__rate_interval]) {BY_NODE}", "{{node}}")],
            "percentunit",
            description="Share of one core; the benchmark target is under 1 % (0.6 s per minute).",
        ),
        timeseries(
            "Process memory (RSS)",
            [target(f"process_resident_memory_bytes {BY_NODE}", "{{node}}")],
            "bytes",
            description="The benchmark target is under 60 MB, 80 MB with eBPF.",
        ),
        timeseries(
            "eBPF programs attached",
            [target(f"kepler_bridge_ebpf_programs_attached{{{NODE}}}", "{{node}}")],
            "short",
        ),
        table(
            "Versions",
            [target(f"kepler_bridge_build_info{{{NODE}}}", instant=True, table=True)],
            hide=["__name__", "Value", "job"],
            rename={},
        ),
    ]
    variables = [variable("node", "label_values(kepler_bridge_build_info, node)", "Node")]
    return dashboard(
        "kepler-bridge-agent",
        "kepler-bridge agent",
        "Is the agent healthy: sources up, sampling time, scrape size, its CPU and memory.",
        variables,
        panels,
    )


# The fleet dashboard reads only the gpu-fleet recording rules (alerts/fleet-rules.src.yaml): a
# few series per node and namespace, so it stays quick over thousands of nodes.
NAMESPACE = 'namespace=~"$namespace"'
TOP = 20  # nodes or namespaces in a ranking panel
RED_FROM_ONE = {
    "thresholds": {
        "mode": "absolute",
        "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
    }
}


def fleet_energy(window: str = "") -> str:
    """CPU + GPU energy (kWh) of the top namespaces: in the last hour, or over the range `window`
    (the average of the 5-minute power times the range)."""
    parts = []
    for kind in ("gpu", "cpu"):
        if window:
            rate = f"namespace:kepler_bridge_pod_{kind}_joules:rate5m{{{NAMESPACE}}}"
            part = f"avg_over_time({rate}[{window}]) * $__range_s"
        else:
            part = f"namespace:kepler_bridge_pod_{kind}_joules:increase1h{{{NAMESPACE}}}"
        # avg_over_time() drops the names, which told the two sides apart for `or`.
        parts.append(f'label_replace({part}, "kind", "{kind}", "", "")')
    return f"topk({TOP}, sum by (namespace) ({' or '.join(parts)}) / 3.6e6)"


def fleet() -> dict[str, Any]:
    """Many nodes at once: power, energy, busy GPUs and accelerators down, by node and namespace."""
    node_power = f"node:gpu_energy_joules:rate5m{{{NODE}}}"
    busy = f"node:gpu_utilization_ratio:sum{{{NODE}}}"
    panels = [
        stat("Nodes with accelerators", f"count(node:gpu:count{{{NODE}}})"),
        stat(
            "Accelerators down",
            f"sum(node:gpu_down:count{{{NODE}}})",
            description="Failing, or reported in the last hour and not now (agent or link down).",
            fieldConfig={"defaults": RED_FROM_ONE},
        ),
        stat(
            "Accelerator power",
            f"sum(node:gpu_power_watts:sum{{{NODE}}})",
            "watt",
            description="The power the accelerators draw now.",
        ),
        stat(
            "GPU busy hours in the selected range",
            f"sum(avg_over_time({busy}[$__range])) * $__range_s / 3600",
            "h",
        ),
        timeseries(
            f"Accelerator power, top {TOP} nodes",
            [target(f"topk({TOP}, {node_power})", "{{node}}")],
            "watt",
            description="From the energy counters, averaged over 5 minutes.",
        ),
        timeseries(
            "Power by namespace (CPU + GPU)",
            [
                target(
                    # Each kind labelled apart: `or` alone keeps one side of a namespace with both.
                    "sum by (namespace) (label_replace("
                    f"namespace:kepler_bridge_pod_gpu_joules:rate5m{{{NAMESPACE}}}, "
                    '"kind", "gpu", "", "") or label_replace('
                    f"namespace:kepler_bridge_pod_cpu_joules:rate5m{{{NAMESPACE}}}, "
                    '"kind", "cpu", "", ""))',
                    "{{namespace}}",
                )
            ],
            "watt",
            fieldConfig={"defaults": {"custom": {"stacking": {"mode": "normal"}}}},
        ),
        bars(
            f"Accelerator energy in the last hour, top {TOP} nodes",
            [
                target(
                    f"topk({TOP}, node:gpu_energy_joules:increase1h{{{NODE}}} / 3.6e6)",
                    "{{node}}",
                    instant=True,
                )
            ],
            "kwatth",
        ),
        bars(
            f"Energy by namespace in the selected range, top {TOP}",
            [target(fleet_energy("$__range"), "{{namespace}}", True)],
            "kwatth",
            description="CPU + GPU; the average of the 5-minute power times the range.",
        ),
        bars(
            f"Energy by namespace in the last hour, top {TOP}",
            [target(fleet_energy(), "{{namespace}}", True)],
            "kwatth",
            width=24,
        ),
        timeseries(
            f"Busy GPUs, top {TOP} nodes",
            [target(f"topk({TOP}, {busy})", "{{node}}")],
            "short",
            description="The sum of utilization: 1 is one GPU busy all the time.",
        ),
        timeseries(
            "Busy GPUs by namespace",
            [target(f"namespace:gpu_utilization_ratio:sum{{{NAMESPACE}}}", "{{namespace}}")],
            "short",
            description="GPUs the kubelet assigned to one of the namespace's containers.",
        ),
        timeseries(
            f"CPU package power, top {TOP} nodes",
            [
                target(
                    f"topk({TOP}, node:kepler_bridge_node_cpu_joules:rate5m{{{NODE}}})", "{{node}}"
                )
            ],
            "watt",
        ),
        timeseries(
            "Accelerators down",
            [target(f"sum(node:gpu_down:count{{{NODE}}})", "down")],
            "short",
            fieldConfig={"defaults": RED_FROM_ONE},
        ),
        table(
            "Nodes with accelerators down",
            [
                target(f"topk(50, node:gpu_down:count{{{NODE}}} > 0)", instant=True, table=True),
                target(
                    f"node:gpu:count{{{NODE}}} and on (node) node:gpu_down:count > 0",
                    instant=True,
                    table=True,
                ),
            ],
            hide=["__name__"],
            rename={"Value #A": "Down", "Value #B": "Accelerators"},
        ),
    ]
    variables = [
        variable("node", "label_values(node:gpu:count, node)", "Node"),
        # CPU or GPU: most namespaces have CPU energy only.
        variable(
            "namespace",
            'label_values({__name__=~"namespace:kepler_bridge_pod_(cpu|gpu)_joules:rate5m"}, '
            "namespace)",
            "Namespace",
        ),
    ]
    return dashboard(
        "kepler-bridge-fleet",
        "Accelerator fleet",
        "Power, energy, busy GPUs and accelerators down across nodes and namespaces, from the "
        "gpu-fleet recording rules.",
        variables,
        panels,
    )


DASHBOARDS = {
    "accelerators.json": accelerators,
    "workload-energy.json": workload_energy,
    "agent.json": agent,
    "fleet.json": fleet,
}


def rendered() -> dict[Path, str]:
    """Every dashboard file and the text it must hold."""
    return {
        HERE / name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }
