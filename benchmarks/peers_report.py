"""The table and the target line of benchmarks/peers.py: readings in, text out, nothing measured."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

AGENT, NVITOP, NODE = "kepler-bridge", "nvitop-exporter", "node_exporter"
EXPORTERS = (AGENT, NVITOP, NODE)
PEERS = (NVITOP, NODE)
SHORT = {NVITOP: "nvitop", NODE: "node"}  # the ratio columns: kepler-bridge (kb) over the peer


@dataclass(frozen=True)
class Reading:
    """What one exporter cost in one scenario of one run."""

    p50_ms: float
    p99_ms: float
    rps: float
    cpu_s_min: float
    pss_mb: float
    rss_mb: float
    plain_kib: float
    gzip_kib: float
    sample_ms: float | None = None  # kepler_bridge_sample_duration_seconds, the agent only


# Field of Reading -> (row label, number format).
ROWS = {
    "p50_ms": ("scrape p50, sequential, interleaved (ms)", "{:.2f}"),
    "p99_ms": ("scrape p99, sequential, interleaved (ms)", "{:.2f}"),
    "rps": ("throughput, 8 clients (req/s)", "{:.0f}"),
    "cpu_s_min": ("CPU, 1 s interval, scraped every 15 s (s/min)", "{:.3f}"),
    "pss_mb": ("PSS, all processes (MB)", "{:.1f}"),
    "rss_mb": ("RSS, all processes (MB)", "{:.1f}"),
    "plain_kib": ("bytes per scrape, plain (KiB)", "{:.1f}"),
    "gzip_kib": ("bytes per scrape, gzip (KiB)", "{:.1f}"),
    "sample_ms": ("kepler_bridge_sample_duration_seconds (ms)", "{:.2f}"),
}

# (what, field, peer, highest ratio agent/peer) of the targets.
RATIO_TARGETS = (
    ("scrape p99 / nvitop", "p99_ms", NVITOP, 0.15),
    ("scrape p99 / node_exporter", "p99_ms", NODE, 0.3),
    ("CPU / nvitop", "cpu_s_min", NVITOP, 0.05),
    ("PSS / nvitop", "pss_mb", NVITOP, 1.3),
)

Run = dict[str, Reading]  # exporter -> its reading in one scenario of one run


def ratio(run: Run, field: str, peer: str) -> float | None:
    """The agent's value over the peer's in one run (None where either is missing or zero)."""
    mine, theirs = getattr(run[AGENT], field), getattr(run[peer], field)
    if mine is None or not theirs:
        return None
    return mine / theirs


def median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def cell(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def table(title: str, runs: list[Run]) -> str:
    """One scenario: a row per measure, a column per exporter and per ratio, medians over runs."""
    header = ["measure", *EXPORTERS, *(f"kb/{SHORT[peer]}" for peer in PEERS)]
    lines = [[*header]]
    for field in (f.name for f in dataclasses.fields(Reading)):
        label, form = ROWS[field]
        values = [median([getattr(run[name], field) for run in runs]) for name in EXPORTERS]
        ratios = [median([ratio(run, field, peer) for run in runs]) for peer in PEERS]
        lines.append(
            [label, *(cell(v, form) for v in values), *(cell(r, "{:.3f}") for r in ratios)]
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    suffix = f", median of {len(runs)} runs" if len(runs) > 1 else ""
    text = [f"{title}{suffix}"]
    for line in lines:
        text.append(
            "  ".join(
                [line[0].ljust(widths[0])]
                + [item.rjust(width) for item, width in zip(line[1:], widths[1:])]
            )
        )
    return "\n".join(text)


def verdict(value: float | None, limit: float) -> str:
    return "unknown" if value is None else ("met" if value <= limit else "missed")


def targets_line(scenarios: dict[str, list[Run]], sample_limits_ms: dict[str, float]) -> str:
    """The issue's targets, median ratio per scenario, met where every scenario meets it."""
    parts = []
    for what, field, peer, limit in RATIO_TARGETS:
        found = [median([ratio(run, field, peer) for run in runs]) for runs in scenarios.values()]
        worst = None if None in found else max(v for v in found if v is not None)
        shown = "/".join(cell(value, "{:.3f}") for value in found)
        parts.append(f"{what} {shown} <= {limit:g} {verdict(worst, limit)}")
    for name, limit in sample_limits_ms.items():
        value = median([run[AGENT].sample_ms for run in scenarios[name]])
        parts.append(
            f"sample {name} {cell(value, '{:.2f}')} ms <= {limit:g} ms {verdict(value, limit)}"
        )
    return f"targets ({'/'.join(scenarios)}): " + "; ".join(parts)
