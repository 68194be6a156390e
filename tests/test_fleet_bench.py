"""benchmarks/fleet.py in small: two agents, a real Prometheus and the remote-write sink, and
nothing of them left running after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from promserver import ROOT, binary

pytestmark = pytest.mark.e2e


def _rows(output: str) -> dict[str, list[str]]:
    """Table rows by quantity: the cells after it."""
    cells = [line.strip("|").split("|") for line in output.splitlines() if line.startswith("| ")]
    return {row[0].strip(): [cell.strip() for cell in row[1:]] for row in cells}


def _node_names() -> set[str]:
    """The --node-name of every kepler-bridge process on the host now."""
    names = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--node-name" in args and args.index(b"--node-name") + 1 < len(args):
            names.add(args[args.index(b"--node-name") + 1].decode(errors="replace"))
    return names


def test_fleet_benchmark_measures_a_small_fleet_and_stops_it(tmp_path: Path) -> None:
    binary("prometheus")
    tag = f"fleet-{os.getpid()}"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fleet.py"),
            *("--agents", "2", "--gpus", "1", "--interval", "1", "--minutes", "0.1"),
            *("--node-prefix", tag),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(result.stdout)
    assert float(rows["remote write: bytes the sink received"][0]) > 0, result.stdout
    assert float(rows["remote write: prometheus_remote_storage_bytes"][0]) > 0
    assert float(rows["Prometheus head series (scraped + recorded)"][0]) > 2 * 30
    assert float(rows["agents' memory (PSS, all their processes)"][1]) > 0
    assert not {name for name in _node_names() if name.startswith(tag)}, "agents left running"
