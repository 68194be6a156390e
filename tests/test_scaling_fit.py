"""The fitted lines and the table of benchmarks/scaling.py, from made-up readings."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from scaling_fit import Point, fit, report  # noqa: E402


def point(gpus: int, processes: int, sample_ms: float, cpu: float = 1.0) -> Point:
    return Point(
        gpus=gpus,
        extra=processes - 100,
        processes=processes,
        samples=30,
        sample_ms=sample_ms,
        sample_p90_ms=sample_ms * 1.1,
        cpu_s_min=cpu,
        pss_mb=40.0,
        runnable=1.5,
        new_per_s=0.0,
    )


def grid(cost: Callable[[int, int], float]) -> list[Point]:
    return [
        point(g, p, cost(g, p), cpu=0.1 + cost(g, p) / 10)
        for g in (1, 8, 16)
        for p in (200, 1100, 3100, 10100)
    ]


def test_an_exact_line_is_found_with_no_residual() -> None:
    line = fit(grid(lambda g, p: 2.0 + 0.0005 * p + 0.25 * g), lambda p: p.sample_ms)
    assert line.intercept == pytest.approx(2.0)
    assert line.per_process == pytest.approx(0.0005)
    assert line.per_gpu == pytest.approx(0.25)
    assert max(abs(r) for r in line.residuals) < 1e-9
    assert line.r_squared == pytest.approx(1.0)


def test_a_curve_shows_in_the_residuals() -> None:
    line = fit(grid(lambda g, p: 1.0 + (p / 1000) ** 2), lambda p: p.sample_ms)
    assert max(abs(r) for r in line.residuals) > 5  # ms: far from a line
    assert len(line.residuals) == 12
    assert sum(line.residuals) == pytest.approx(0, abs=1e-6)  # least squares with an intercept
    rows = report(grid(lambda g, p: 1.0 + (p / 1000) ** 2)).splitlines()[1:13]
    assert all(row.split()[7] != "+0.00" for row in rows)  # each point's residual, shown


def test_a_variable_that_does_not_vary_gets_no_slope() -> None:
    points = [point(8, p, 1.0 + 0.001 * p) for p in (200, 1100, 3100)]
    line = fit(points, lambda p: p.sample_ms)
    assert line.per_gpu is None
    assert line.per_process == pytest.approx(0.001)


def test_the_report_states_the_constants_and_every_point() -> None:
    text = report(grid(lambda g, p: 2.0 + 0.0005 * p + 0.25 * g))
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["GPUs", "extra"]
    assert len([line for line in lines[1:13] if line.strip()]) == 12
    sample = next(line for line in lines if line.startswith("sample = "))
    assert sample.startswith("sample = 2.000 ms + 0.500 us per process + 0.250 ms per GPU")
    assert "12 points" in sample and "largest residual 0.000 ms" in sample
    cpu = next(line for line in lines if line.startswith("CPU = "))
    assert "s/min per 1000 processes" in cpu and "s/min per GPU" in cpu


def test_make_bench_runs_scaling_and_ends_with_the_peers_targets_line() -> None:
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    scripts = [line.split()[-1] for line in recipe.splitlines() if "benchmarks/" in line]
    assert "benchmarks/scaling.py" in scripts
    assert scripts[-1] == "benchmarks/peers.py"  # its line of targets ends `make bench`


def test_points_over_the_process_cap_get_a_line_of_their_own_below_it() -> None:
    points = [
        replace(point, sample_ms=point.sample_ms * (3 if point.processes > 5000 else 1))
        for point in grid(lambda g, p: 2.0 + 0.0005 * p + 0.25 * g)
    ]
    text = report(points, cap=5000).splitlines()
    within = [line for line in text if line.startswith("within --max-processes 5000 (9 points)")]
    assert len(within) == 2
    assert "sample = 2.000 ms + 0.500 us per process + 0.250 ms per GPU" in within[0]
    assert "largest residual 0.000 ms" not in text[text.index("") + 1]  # all points: not a line
    assert not any(line.startswith("within") for line in report(points, cap=0).splitlines())
    assert not any(line.startswith("within") for line in report(points, cap=20000).splitlines())
