"""The IsolationForest of one device: fitted in a short-lived child with scikit-learn (an optional
extra, never imported by the worker), scored here in plain Python: as scikit-learn scores the rows
it saw, and higher than it does for a sample beyond the range a node's rows spanned.

Scoring one sample walks 50 trees of at most 8 levels, about 0.1 ms, where scikit-learn's
`score_samples` costs milliseconds a call and its import 100 MiB of the worker's memory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any, Mapping, Sequence

from kepler_bridge.anomaly import fit

MIN_ROWS = 30  # fewer rows make no model
FIT_TIMEOUT = 120.0


def missing() -> str:
    """Why the model is off here, or '' where scikit-learn is installed (found, not imported)."""
    try:
        found = all(importlib.util.find_spec(name) is not None for name in ("sklearn", "numpy"))
    except (ImportError, ValueError):  # hidden (sys.modules[name] = None) or half installed
        found = False
    return (
        "" if found else "off: scikit-learn is not installed; pip install 'kepler-bridge[anomaly]'"
    )


def _path_length(n: float) -> float:
    if n <= 1:
        return 0.0
    if n == 2:
        return 1.0
    return 2.0 * (math.log(n - 1.0) + 0.5772156649015329) - 2.0 * (n - 1.0) / n


class Forest:
    """A fitted forest: per tree the node lists the child printed."""

    def __init__(self, fitted: Mapping[str, Any], fitted_at: float) -> None:
        self.trees = [tuple(map(list, tree)) for tree in fitted["trees"]]
        self.norm = _path_length(float(fitted["samples"]))
        self.fitted_at = fitted_at

    def score(self, vector: Sequence[float]) -> float:
        """2^(-mean isolation depth / expected depth): near 1 for a sample isolated at once,
        about 0.5 and below for ordinary ones."""
        total = 0.0
        for tree in self.trees:
            total += _path(tree, vector)
        mean = total / max(len(self.trees), 1)
        return math.pow(2.0, -mean / self.norm) if self.norm > 0 else 0.5


def _path(tree: tuple[list[Any], ...], vector: Sequence[float]) -> float:
    """The expected isolation depth of `vector` in one tree. Beyond the range a node's rows spanned
    on its feature, a split drawn over the range widened to the sample isolates it there with the
    chance excess / widened range (scikit-learn gives it the depth of the rows at the edge)."""
    left, right, feature, threshold, length, low, high = tree
    total, weight, node = 0.0, 1.0, 0
    while left[node] != node:
        value = vector[feature[node]]
        if value < low[node] or value > high[node]:
            excess = low[node] - value if value < low[node] else value - high[node]
            chance = excess / (high[node] - low[node] + excess)
            total += weight * chance * length[node]
            weight *= 1.0 - chance
        node = left[node] if value <= threshold[node] else right[node]
    return total + weight * length[node]


def fit_all(
    rows: Mapping[str, Sequence[Sequence[float]]], seed: int, now: float
) -> dict[str, Forest]:
    """A forest per device from its rows, fitted in one child process; raises RuntimeError with
    the child's reason where it fails."""
    request = json.dumps(
        {"seed": seed, "devices": {k: list(map(list, v)) for k, v in rows.items()}}
    )
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-I", fit.__file__],
            input=request.encode(),
            capture_output=True,
            timeout=FIT_TIMEOUT,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"the model fit did not finish: {err}") from err
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"the model fit failed: {reason[0][:300]}")
    answer = json.loads(done.stdout)
    return {uuid: Forest(fitted, now) for uuid, fitted in answer.items()}
