"""The table and the target line of benchmarks/peers.py, from made-up readings."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from peers_report import AGENT, NODE, NVITOP, ROWS, Reading, Run, table, targets_line  # noqa: E402

BASE = Reading(
    p50_ms=1, p99_ms=2, rps=100, cpu_s_min=0.5, pss_mb=20, rss_mb=30, plain_kib=100, gzip_kib=7
)


def run(agent: Reading, nvitop: Reading, node: Reading) -> Run:
    return {AGENT: agent, NVITOP: nvitop, NODE: node}


def row(text: str, label: str) -> list[str]:
    """The cells after the label of the row that starts with `label`."""
    line = next(line for line in text.splitlines() if line.startswith(label))
    return line[len(label) :].split()


def test_table_shows_medians_of_values_and_of_per_run_ratios() -> None:
    runs = [
        run(replace(BASE, p99_ms=mine, sample_ms=sample), replace(BASE, p99_ms=theirs), BASE)
        for mine, theirs, sample in ((1, 10, 2.0), (3, 10, 2.5), (2, 40, 9.0))
    ]
    text = table("host", runs)
    assert text.splitlines()[0] == "host, median of 3 runs"
    assert text.splitlines()[1].split()[-2:] == ["kb/nvitop", "kb/node"]
    # Ratios 0.1, 0.3, 0.05 per run: their median, not the ratio of the medians (0.2).
    assert row(text, ROWS["p99_ms"][0]) == ["2.00", "10.00", "2.00", "0.100", "1.000"]
    assert row(text, ROWS["sample_ms"][0]) == ["2.50", "-", "-", "-", "-"]


def test_one_run_has_no_median_note_and_a_zero_peer_no_ratio() -> None:
    text = table("host", [run(BASE, BASE, replace(BASE, cpu_s_min=0))])
    assert text.splitlines()[0] == "host"
    assert row(text, ROWS["cpu_s_min"][0])[-3:] == [
        "0.000",
        "1.000",
        "-",
    ]


def test_a_target_is_met_only_where_every_host_meets_it() -> None:
    peer = replace(BASE, p99_ms=10, cpu_s_min=1, pss_mb=20)
    small = run(replace(BASE, p99_ms=1, cpu_s_min=0.01, sample_ms=2), peer, peer)
    large = run(replace(BASE, p99_ms=5, cpu_s_min=0.01, sample_ms=11), peer, peer)
    line = targets_line({"8x16": [small], "8x16+3000": [large]}, {"8x16": 3, "8x16+3000": 10})
    assert line.startswith("targets (8x16/8x16+3000): ")
    assert "scrape p99 / nvitop 0.100/0.500 <= 0.15 missed" in line
    assert "scrape p99 / node_exporter 0.100/0.500 <= 0.3 missed" in line
    assert "CPU / nvitop 0.010/0.010 <= 0.05 met" in line
    assert "PSS / nvitop 1.000/1.000 <= 1.3 met" in line
    assert "sample 8x16 2.00 ms <= 3 ms met" in line
    assert "sample 8x16+3000 11.00 ms <= 10 ms missed" in line
