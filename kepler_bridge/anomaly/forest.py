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
from array import array
from typing import Any, Mapping, Sequence

from kepler_bridge.anomaly import fit
from kepler_bridge.turns import normal_children

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


# Per tree: left, right, feature (node indices) and threshold, length, low, high (doubles).
Tree = tuple[array, array, array, array, array, array, array]
TYPECODES = "iiidddd"  # arrays, not lists of Python numbers: 49 bytes a node, not 120


class Forest:
    """A fitted forest: per tree the node lists the child printed, as arrays."""

    def __init__(self, fitted: Mapping[str, Any], fitted_at: float) -> None:
        self.trees: list[Tree] = [_tree(nodes) for nodes in fitted["trees"]]
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


def _tree(nodes: Sequence[Sequence[float]]) -> Tree:
    """One tree's node lists as printed by the child, each in its array."""
    left, right, feature, threshold, length, low, high = (
        array(code, column) for code, column in zip(TYPECODES, nodes, strict=True)
    )
    return left, right, feature, threshold, length, low, high


def _path(tree: Tree, vector: Sequence[float]) -> float:
    """The expected isolation depth of `vector` in one tree. Beyond the range a node's rows spanned
    on its feature, a split drawn over the range widened to the sample isolates it there with the
    chance excess / widened range (scikit-learn gives it the depth of the rows at the edge)."""
    left, right, feature, threshold, length, low, high = tree
    total, weight, node, child = 0.0, 1.0, 0, left[0]
    while child != node:  # each item read once: an array makes a new number at every read
        value = vector[feature[node]]
        lo, hi = low[node], high[node]
        if value < lo or value > hi:
            excess = lo - value if value < lo else value - hi
            chance = excess / (hi - lo + excess)
            total += weight * chance * length[node]
            weight *= 1.0 - chance
        node = child if value <= threshold[node] else right[node]
        child = left[node]
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
        with normal_children():  # the fit thread inherits SCHED_IDLE from the anomaly thread
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
