"""The table and the fitted lines of benchmarks/scaling.py: readings in, text out, no measuring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Point:
    """What the agent cost on one host: GPUs, processes, and the readings over one window."""

    gpus: int
    extra: int  # sleeping processes added for this point
    processes: int  # processes on the host during the window, counted in /proc
    samples: int  # distinct samples read in the window
    sample_ms: float  # median of kepler_bridge_sample_duration_seconds
    sample_p90_ms: float
    cpu_s_min: float  # utime + stime of the agent's processes over the window
    pss_mb: float  # PSS of the agent's processes at the end of the window
    runnable: float  # tasks runnable on the host (this benchmark's too), mean over the window
    new_per_s: float  # processes started on the host a second (other jobs' churn), mean


@dataclass(frozen=True)
class Line:
    """value = intercept + per_process * processes + per_gpu * gpus, by least squares.

    A slope is None where its variable did not vary over the points."""

    intercept: float
    per_process: float | None
    per_gpu: float | None
    residuals: tuple[float, ...]  # measured - fitted, per point in order
    r_squared: float | None  # None where the values did not vary


def solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """x with matrix @ x = vector (Gaussian elimination, partial pivoting)."""
    size = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(size)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda row: abs(rows[row][column]))
        if abs(rows[pivot][column]) < 1e-12:
            raise ValueError("the points do not determine a line: vary processes or GPUs")
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for row in range(size):
            if row != column:
                factor = rows[row][column] / rows[column][column]
                rows[row] = [a - factor * b for a, b in zip(rows[row], rows[column])]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def fit(points: list[Point], value: Callable[[Point], float]) -> Line:
    """The least-squares line of `value` against processes and GPUs (those that vary)."""
    varies = {
        "per_process": len({p.extra for p in points}) > 1,
        "per_gpu": len({p.gpus for p in points}) > 1,
    }
    regressors = {"per_process": lambda p: float(p.processes), "per_gpu": lambda p: float(p.gpus)}
    used = [name for name, yes in varies.items() if yes]
    design = [[1.0, *(regressors[name](p) for name in used)] for p in points]
    measured = [value(p) for p in points]
    columns = range(len(design[0]))
    normal = [[sum(row[i] * row[j] for row in design) for j in columns] for i in columns]
    right = [sum(row[i] * y for row, y in zip(design, measured)) for i in columns]
    found = solve(normal, right)
    fitted = [sum(c * x for c, x in zip(found, row)) for row in design]
    residuals = tuple(y - f for y, f in zip(measured, fitted))
    mean = sum(measured) / len(measured)
    total = sum((y - mean) ** 2 for y in measured)
    slopes = dict(zip(used, found[1:]))
    return Line(
        intercept=found[0],
        per_process=slopes.get("per_process"),
        per_gpu=slopes.get("per_gpu"),
        residuals=residuals,
        r_squared=1 - sum(r * r for r in residuals) / total if total > 0 else None,
    )


def formula(line: Line, unit: str, process_scale: float, process_label: str) -> str:
    """`a unit + b process_label + c unit per GPU`, b the process slope times process_scale."""
    parts = [f"{line.intercept:.3f} {unit}"]
    if line.per_process is not None:
        parts.append(f"{line.per_process * process_scale:.3f} {process_label}")
    if line.per_gpu is not None:
        parts.append(f"{line.per_gpu:.3f} {unit} per GPU")
    worst = max(abs(r) for r in line.residuals)
    fit_quality = "" if line.r_squared is None else f", R^2 {line.r_squared:.3f}"
    return (
        f"{' + '.join(parts)}  (least squares over {len(line.residuals)} points{fit_quality}; "
        f"largest residual {worst:.3f} {unit})"
    )


HEADER = (
    "GPUs",
    "extra",
    "host procs",
    "samples",
    "sample p50 ms",
    "p90 ms",
    "fit ms",
    "resid ms",
    "CPU s/min",
    "fit",
    "resid",
    "PSS MB",
    "runnable",
    "new/s",
)


def table(points: list[Point], sample: Line, cpu: Line) -> str:
    """A row per point: readings, the fitted values and the residuals, in aligned columns."""
    lines = [list(HEADER)]
    for point, sample_residual, cpu_residual in zip(points, sample.residuals, cpu.residuals):
        lines.append(
            [
                str(point.gpus),
                str(point.extra),
                str(point.processes),
                str(point.samples),
                f"{point.sample_ms:.2f}",
                f"{point.sample_p90_ms:.2f}",
                f"{point.sample_ms - sample_residual:.2f}",
                f"{sample_residual:+.2f}",
                f"{point.cpu_s_min:.3f}",
                f"{point.cpu_s_min - cpu_residual:.3f}",
                f"{cpu_residual:+.3f}",
                f"{point.pss_mb:.1f}",
                f"{point.runnable:.1f}",
                f"{point.new_per_s:.0f}",
            ]
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(HEADER))]
    return "\n".join(
        "  ".join(item.rjust(width) for item, width in zip(line, widths)) for line in lines
    )


def fits(points: list[Point]) -> tuple[Line, Line]:
    """The lines of sample cost and of CPU over `points`."""
    return fit(points, lambda p: p.sample_ms), fit(points, lambda p: p.cpu_s_min)


def formulas(sample: Line, cpu: Line, prefix: str = "") -> list[str]:
    return [
        f"{prefix}sample = {formula(sample, 'ms', 1e3, 'us per process')}",
        f"{prefix}CPU = {formula(cpu, 's/min', 1e3, 's/min per 1000 processes')}",
    ]


def report(points: list[Point], cap: int = 0) -> str:
    """The table and the fitted lines; again over the points within the agent's process cap
    (--max-processes `cap`, 0: none) where some lie above it."""
    sample, cpu = fits(points)
    text = [table(points, sample, cpu), "", *formulas(sample, cpu)]
    within = [p for p in points if p.processes <= cap]
    if 0 < cap and len(within) < len(points) and len({p.extra for p in within}) > 1:
        text += formulas(*fits(within), f"within --max-processes {cap} ({len(within)} points): ")
    return "\n".join(text)
